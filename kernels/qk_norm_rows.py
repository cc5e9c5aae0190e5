"""The Q/K norm backward rows of L1/051 (Gemma3 RMSNorm with scale 1 + w), one kernel:

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

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import BFloat16, Float32, Int32


VECTOR = 8  # bf16 elements per 16-byte access
WARPS = 8
CTAS_PER_SM = 4
MAX_HEAD_DIM = 1024


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


class QkNormBackward:
    """dq, dk and the per-CTA partials of both norm-weight gradients (the caller adds them:
    051's summed product does it in its idle warps, column_sum.ColumnSumsInWarps)."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.vectors = head_dim // VECTOR
        self.vectors_per_lane = -(-self.vectors // 32)

    @cute.jit
    def __call__(self, grad_q: cute.Tensor, pre_q: cute.Tensor, rstd_q: cute.Tensor, normed_q: cute.Tensor,
                 weight_q: cute.Tensor, dq: cute.Tensor, grad_k: cute.Tensor, pre_k: cute.Tensor,
                 rstd_k: cute.Tensor, normed_k: cute.Tensor, weight_k: cute.Tensor, dk: cute.Tensor,
                 partials: cute.Tensor, ctas: Int32, stream: cuda.CUstream):
        """partials: fp32 [rows >= ctas, 2d]: one row per CTA of the grid, its q sums then its k sums."""
        q = (head_rows(grad_q), head_rows(pre_q), head_rows(rstd_q), head_rows(normed_q), weight_q, token_rows(dq))
        k = (head_rows(grad_k), head_rows(pre_k), head_rows(rstd_k), head_rows(normed_k), weight_k, token_rows(dk))
        width = 2 * self.head_dim
        cta_rows = cute.make_tensor(partials.iterator, cute.make_layout((ctas, width), stride=(width, 1)))
        # (Summing the partials here, by the grid's last CTAs, was measured in session 14: ~3 us
        # less host time a call but 1.5-8 us more GPU time, a worse mean.)
        self.kernel(*q, *k, cta_rows).launch(grid=[ctas, 1, 1], block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, g_q: cute.Tensor, x_q: cute.Tensor, r_q: cute.Tensor, n_q: cute.Tensor, w_q: cute.Tensor,
               o_q: cute.Tensor, g_k: cute.Tensor, x_k: cute.Tensor, r_k: cute.Tensor, n_k: cute.Tensor,
               w_k: cute.Tensor, o_k: cute.Tensor, m_part: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        lane, warp = tidx % 32, tidx // 32
        vpl = self.vectors_per_lane
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=16 * 8)
        scale_q = self.one_plus(atom, w_q, lane)
        scale_k = self.one_plus(atom, w_k, lane)
        sums_q = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        sums_k = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        sums_q.fill(0.0)
        sums_k.fill(0.0)
        rows_q, rows_k = cute.size(g_q, mode=[0]), cute.size(g_k, mode=[0])
        for r in cutlass.range(bidx * WARPS + warp, rows_q + rows_k, ctas * WARPS):
            if r < rows_q:
                self.row(atom, g_q, x_q, r_q, n_q, o_q, scale_q, sums_q, r, lane)
            else:
                self.row(atom, g_k, x_k, r_k, n_k, o_k, scale_k, sums_k, r - rows_q, lane)
        smem = cutlass.memory.SmemAllocator()
        across = smem.allocate_tensor(Float32, cute.make_layout((self.head_dim, WARPS)), byte_alignment=16)
        d = self.head_dim
        row = m_part[bidx, None]
        self.partial_row(sums_q, across, cute.make_tensor(row.iterator, cute.make_layout((d,))), lane, warp, tidx)
        self.partial_row(sums_k, across, cute.make_tensor(row.iterator + d, cute.make_layout((d,))), lane, warp, tidx)

    @cute.jit
    def one_plus(self, atom, m_weight, lane):
        """(1 + norm weight) in fp32 for this lane's columns."""
        scale = cute.make_rmem_tensor((VECTOR, self.vectors_per_lane), Float32)
        staging = cute.make_rmem_tensor((VECTOR,), BFloat16)
        scale.fill(0.0)
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            if lane + 32 * j < self.vectors:
                cute.copy(atom, cute.zipped_divide(m_weight, (VECTOR,))[None, lane + 32 * j], staging)
                scale[None, j].store(staging.load().to(Float32) + 1.0)
        return scale

    @cute.jit
    def row(self, atom, m_grad, m_pre, m_rstd, m_normed, m_out, scale, sums, r, lane):
        """One head row: out = bf16(rstd * gn - x * rstd^3 * sum(gn * x) / d) with gn = grad * scale;
        sums += grad * normed."""
        vpl = self.vectors_per_lane
        grad = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        pre = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        staging = cute.make_rmem_tensor((VECTOR,), BFloat16)
        grad.fill(0.0)
        pre.fill(0.0)
        rstd = m_rstd[r, 0]
        dot = Float32(0.0)
        for j in cutlass.range_constexpr(vpl):
            v = lane + 32 * j
            if v < self.vectors:
                cute.copy(atom, cute.zipped_divide(m_grad[r, None], (VECTOR,))[None, v], staging)
                grad[None, j].store(staging.load().to(Float32))
                cute.copy(atom, cute.zipped_divide(m_pre[r, None], (VECTOR,))[None, v], staging)
                pre[None, j].store(staging.load().to(Float32))
                cute.copy(atom, cute.zipped_divide(m_normed[r, None], (VECTOR,))[None, v], staging)
                sums[None, j].store(sums[None, j].load() + grad[None, j].load() * staging.load().to(Float32))
                gn = grad[None, j].load() * scale[None, j].load()
                dot += (gn * pre[None, j].load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        dot = cute.arch.warp_reduction(dot, lambda a, b: a + b)
        coefficient = rstd * rstd * rstd * dot * (1.0 / self.head_dim)
        for j in cutlass.range_constexpr(vpl):
            v = lane + 32 * j
            if v < self.vectors:
                gn = grad[None, j].load() * scale[None, j].load()
                staging.store((gn * rstd - pre[None, j].load() * coefficient).to(BFloat16))
                cute.copy(atom, staging, cute.zipped_divide(m_out[r, None], (VECTOR,))[None, v])

    @cute.jit
    def partial_row(self, sums, across, m_partial_row, lane, warp, tidx):
        """The CTA's partial row: its warps' sums added in warp order."""
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            v = lane + 32 * j
            if v < self.vectors:
                for e in cutlass.range_constexpr(VECTOR):
                    across[v * VECTOR + e, warp] = sums[e, j]
        cute.arch.barrier()
        for c in cutlass.range(tidx, self.head_dim, 32 * WARPS):
            total = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                total += across[c, w]
            m_partial_row[c] = total
        cute.arch.barrier()  # `across` is reused for the next partial row
