"""The Q/K norm backward rows of L1/051 (Gemma3 RMSNorm with scale 1 + w), as the prologue of
051's summed product:

    dq = bf16(rms_dx(grad_query * (1 + q_norm_weight), query_transposed, q_rstd))   per head row
    grad_q_norm_weight = sum over rows of fp32(grad_query) * q_normed                (k likewise)

Work split: one warp per (token, head) row; a lane holds 16-byte vectors of 8 bf16 (d = 256:
one per lane), so the row's dot product is one warp reduction. Warps walk the q rows then the
k rows, grid-stride, a fixed set of rows per warp for a given row count; each keeps fp32 sums
of grad * normed for its lanes' columns, and the CTA adds its warps in warp order into one
partial row per CTA (q then k). The caller adds the partial rows in a fixed order
(`column_sum.ColumnSumsInWarps`): bitwise repeatable norm-weight gradients, no float atomics.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

VECTOR = 8  # bf16 elements per 16-byte access
MAX_HEAD_DIM = 1024


def vector(row, index):
    """16-byte vector `index` (VECTOR bf16) of a row."""
    return cute.zipped_divide(row, (VECTOR,))[None, index]


def head_rows(t):
    """[b, heads, s, d] -> [(s, heads, b), d]: row r = s + seq * (head + heads * b) walks the
    per-head rows through the tensor's own strides."""
    shape, stride = t.shape, t.stride
    return cute.make_tensor(t.iterator, cute.make_layout(((shape[2], shape[1], shape[0]), shape[3]),
                                                         stride=((stride[2], stride[1], stride[0]), stride[3])))


def token_rows(t):
    """[b, s, heads, d] (a view of the projection's [T, heads * d]) -> [(s, heads, b), d], row
    for row the same order as head_rows."""
    shape, stride = t.shape, t.stride
    return cute.make_tensor(t.iterator, cute.make_layout(((shape[1], shape[2], shape[0]), shape[3]),
                                                         stride=((stride[1], stride[2], stride[0]), stride[3])))


def row_coord(r, rows):
    """Row r of a head_rows / token_rows view as its (s, head, b) coordinate: one division by
    the runtime seq (heads is a compile-time count). Indexing the view with the flat r instead
    made each tensor's access divide by seq and by seq * heads (emulated integer divisions: 47
    a four-row batch in the sm_90a prologue, 23 with this). Session 25, H200: 4096 tokens 51.3
    -> 49.2 us a call, 8192 90.6 -> 90.1; the rows stay at ~2.2-2.7 TB/s, so the divisions
    were a small part of their cost."""
    seq, heads = rows.shape[0][0], rows.shape[0][1]
    sh = r // seq
    return (r - sh * seq, sh % heads, sh // heads)


class QkNormBackward:
    """dq, dk and the per-CTA partials of both norm-weight gradients (the caller adds them:
    051's summed product does it in its idle warps, column_sum.ColumnSumsInWarps).

    `run` is the whole pass for the threads of one CTA, written as another kernel's prologue
    (the GEMM core's `prologue`: every CTA of 051's summed product's persistent grid, before
    its main loop). A warp keeps `in_flight` rows' loads outstanding at once: its 16-byte loads
    of the next rows are issued before the first row's reduction, so the 12 warps of a Hopper
    GEMM CTA keep as many bytes in flight as the 32 warps an SM of the kernel this replaced
    (one row each). Session 15 on the H200: 4 rows matched that kernel's speed at T = 8192
    (the call 85-87 us either way); 8 were slower (91-92)."""

    def __init__(self, head_dim: int, in_flight: int = 1):
        self.head_dim, self.in_flight = head_dim, in_flight
        self.vectors = head_dim // VECTOR
        self.vectors_per_lane = -(-self.vectors // 32)

    def scratch_bytes(self, threads: int) -> int:
        """Shared memory `run` needs: one fp32 row of the head dim per warp."""
        return 4 * self.head_dim * (threads // 32)

    def arguments(self, grad_q, pre_q, rstd_q, normed_q, weight_q, dq, grad_k, pre_k, rstd_k, normed_k, weight_k,
                  dk, cta_rows):
        """`run`'s arguments: per-head [b, heads, s, d] tensors as rows, dq/dk [b, s, heads, d]
        as rows in the same order, the partial rows [ctas, 2d]."""
        return ((head_rows(grad_q), head_rows(pre_q), head_rows(rstd_q), head_rows(normed_q), weight_q,
                 token_rows(dq)),
                (head_rows(grad_k), head_rows(pre_k), head_rows(rstd_k), head_rows(normed_k), weight_k,
                 token_rows(dk)), cta_rows)

    @cute.jit
    def run(self, args, scratch, tidx, threads: int):
        """This CTA's share of the rows, then its partial row. scratch: shared memory of
        `scratch_bytes(threads)`, free for the call (fp32)."""
        q, k, m_part = args
        g_q, x_q, r_q, n_q, w_q, o_q = q
        g_k, x_k, r_k, n_k, w_k, o_k = k
        warps = threads // 32
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        lane, warp = tidx % 32, tidx // 32
        vpl, flight = self.vectors_per_lane, self.in_flight
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=16 * 8)
        scale_q = self.one_plus(atom, w_q, lane)
        scale_k = self.one_plus(atom, w_k, lane)
        sums_q = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        sums_k = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        sums_q.fill(0.0)
        sums_k.fill(0.0)
        # the rows in flight: bf16 as loaded, and each row's rstd
        grad = cute.make_rmem_tensor((VECTOR, vpl, flight), BFloat16)
        pre = cute.make_rmem_tensor((VECTOR, vpl, flight), BFloat16)
        normed = cute.make_rmem_tensor((VECTOR, vpl, flight), BFloat16)
        rstd = cute.make_rmem_tensor((flight,), Float32)
        slots = (grad, pre, normed, rstd)
        rows_q, rows_k = cute.size(g_q, mode=[0]), cute.size(g_k, mode=[0])
        stride = ctas * warps
        for first in cutlass.range(bidx * warps + warp, rows_q + rows_k, stride * flight):
            for i in cutlass.range_constexpr(flight):
                r = first + i * stride
                if r < rows_q:
                    self.load(atom, g_q, x_q, r_q, n_q, row_coord(r, g_q), lane, *slots, i)
                else:
                    if r < rows_q + rows_k:
                        self.load(atom, g_k, x_k, r_k, n_k, row_coord(r - rows_q, g_k), lane, *slots, i)
            for i in cutlass.range_constexpr(flight):
                r = first + i * stride
                if r < rows_q:
                    self.finish(atom, o_q, scale_q, sums_q, row_coord(r, g_q), lane, *slots, i)
                else:
                    if r < rows_q + rows_k:
                        self.finish(atom, o_k, scale_k, sums_k, row_coord(r - rows_q, g_k), lane, *slots, i)
        across = cute.make_tensor(cute.recast_ptr(scratch, dtype=Float32), cute.make_layout((self.head_dim, warps)))
        d = self.head_dim
        row = m_part[bidx, None]
        self.partial_row(sums_q, across, cute.make_tensor(row.iterator, cute.make_layout((d,))), lane, warp, tidx,
                         threads)
        self.partial_row(sums_k, across, cute.make_tensor(row.iterator + d, cute.make_layout((d,))), lane, warp,
                         tidx, threads)

    @cute.jit
    def one_plus(self, atom, m_weight, lane):
        """(1 + norm weight) in fp32 for this lane's columns."""
        scale = cute.make_rmem_tensor((VECTOR, self.vectors_per_lane), Float32)
        staging = cute.make_rmem_tensor((VECTOR,), BFloat16)
        scale.fill(0.0)
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            if lane + 32 * j < self.vectors:
                cute.copy(atom, vector(m_weight, lane + 32 * j), staging)
                scale[None, j].store(staging.load().to(Float32) + 1.0)
        return scale

    @cute.jit
    def load(self, atom, m_grad, m_pre, m_rstd, m_normed, r, lane, grad, pre, normed, rstd, i):
        """The loads of head row r (a `row_coord`) into in-flight slot i."""
        rstd[i] = m_rstd[r, 0]
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            v = lane + 32 * j
            if v < self.vectors:
                cute.copy(atom, vector(m_grad[r, None], v), grad[None, j, i])
                cute.copy(atom, vector(m_pre[r, None], v), pre[None, j, i])
                cute.copy(atom, vector(m_normed[r, None], v), normed[None, j, i])

    @cute.jit
    def finish(self, atom, m_out, scale, sums, r, lane, grad, pre, normed, rstd, i):
        """Head row r (a `row_coord`) from slot i: out = bf16(rstd * gn - x * rstd^3 * sum(gn * x) / d) with
        gn = grad * scale; sums += grad * normed."""
        staging = cute.make_rmem_tensor((VECTOR,), BFloat16)
        dot = Float32(0.0)
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            if lane + 32 * j < self.vectors:
                g = grad[None, j, i].load().to(Float32)
                sums[None, j].store(sums[None, j].load() + g * normed[None, j, i].load().to(Float32))
                dot += (g * scale[None, j].load() * pre[None, j, i].load().to(Float32)).reduce(
                    cute.ReductionOp.ADD, Float32(0.0), 0)
        dot = cute.arch.warp_reduction(dot, lambda a, b: a + b)
        s = rstd[i]
        coefficient = s * s * s * dot * (1.0 / self.head_dim)
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            v = lane + 32 * j
            if v < self.vectors:
                gn = grad[None, j, i].load().to(Float32) * scale[None, j].load()
                staging.store((gn * s - pre[None, j, i].load().to(Float32) * coefficient).to(BFloat16))
                cute.copy(atom, staging, vector(m_out[r, None], v))

    @cute.jit
    def partial_row(self, sums, across, m_partial_row, lane, warp, tidx, threads: int):
        """The CTA's partial row: its warps' sums added in warp order."""
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            v = lane + 32 * j
            if v < self.vectors:
                for e in cutlass.range_constexpr(VECTOR):
                    across[v * VECTOR + e, warp] = sums[e, j]
        cute.arch.barrier()
        for c in cutlass.range(tidx, self.head_dim, threads):
            total = Float32(0.0)
            for w in cutlass.range_constexpr(threads // 32):
                total += across[c, w]
            m_partial_row[c] = total
        cute.arch.barrier()  # `across` is reused for the next partial row
