"""The Q/K norm backward rows of the QKV backward (Gemma3 RMSNorm with scale 1 + w), as the
prologue of its summed product, per (token, head) row of head dim d:

    g  = fp32(grad_query);  n = fp32(q_normed)
    gn = fp32(bf16(g * (1 + q_norm_weight)))                     (rounded as the contract does)
    dq = bf16(q_rstd * (gn - n * sum_d(gn * n) / d))
    grad_q_norm_weight = sum over rows of g * n                  (k likewise)

The pre-norm input is not read: the normed row and rstd say all the gradient needs.

Work split: one warp per (token, head) row; a lane holds 16-byte vectors of 8 bf16 (d = 256:
one per lane), so the row's dot product is one warp reduction. Warps walk the q rows then the
k rows, grid-stride, a fixed set of rows per warp for a given row count; each keeps fp32 sums
of grad * normed for its lanes' columns, and the CTA adds its warps in warp order into one
partial row per CTA (q then k). The caller adds the partial rows in a fixed order
(`column_sum.ColumnSumsInWarps`): bitwise repeatable norm-weight gradients, no float atomics.

How a warp keeps loads in flight: a ring of up to RING_SLOTS rows (grad and normed, bf16) in
shared memory filled by cp.async where the scratch holds at least two slots, else IN_FLIGHT
rows in registers. Measured on the H200 (graph replay, one process, parity first) while the
rows still read three tensors (the pre-norm input too): the rows alone on one 384-thread CTA an
SM at T = 4096 / 8192, and the op at 1x4096 / 1x8192 / 16x541:
- four rows in registers, q rows head-major: 13.7 / 28.3 us; 49.6 / 88.4 / 94.2;
- the same with the row coordinate from one FastDivmod: 13.2 / 27.5; 48.1 / 86.5 / 92.5;
- ring of 3, head-major: 13.5 / 26.2; 48.0 / 85.5 / 91.4;
- ring of 3, q rows token-major (kept): 13.0 / 24.6; 47.5 / 83.7 / 90.0 (copy of the bytes: 22.7);
- rings of 4 and 6 alone at 8192: 25.9 and 28.0.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

VECTOR = 8  # bf16 elements per 16-byte access
MAX_HEAD_DIM = 1024
RING_SLOTS = 3  # rows a warp stages in shared memory at most: rings of 4 and 6 measured slower
STAGED = 2  # bf16 tensors a row stages: grad and normed
IN_FLIGHT = 4  # rows a warp keeps in registers where the ring does not fit


def vector(row, index):
    """16-byte vector `index` (VECTOR bf16) of a row."""
    return cute.zipped_divide(row, (VECTOR,))[None, index]


def head_rows(t):
    """[b, heads, s, d] -> [(s, heads, b), d]: the per-head rows, indexed by (s, head, b)
    (`row_coord`), through the tensor's own strides."""
    shape, stride = t.shape, t.stride
    return cute.make_tensor(t.iterator, cute.make_layout(((shape[2], shape[1], shape[0]), shape[3]),
                                                         stride=((stride[2], stride[1], stride[0]), stride[3])))


def token_rows(t):
    """[b, s, heads, d] (a view of the projection's [T, heads * d]) -> [(s, heads, b), d],
    indexed as head_rows."""
    shape, stride = t.shape, t.stride
    return cute.make_tensor(t.iterator, cute.make_layout(((shape[1], shape[2], shape[0]), shape[3]),
                                                         stride=((stride[1], stride[2], stride[0]), stride[3])))


def row_coord(r, heads: int, *, by_seq):
    """Row r's (s, head, b) coordinate in a head_rows / token_rows view of `heads` heads, rows
    token-major: r = head + heads * (s + seq * b), a token's heads one after another, so
    neighbouring warps write one contiguous run of the [T, heads * d] operand. One fast
    division by the runtime seq (`by_seq`, a FastDivmod divisor made once a call: a
    multiply-high and a shift instead of an emulated division); `heads` is compile-time."""
    token = r // heads
    b, s = divmod(token, by_seq)
    return (s, r - token * heads, b)


class Side(NamedTuple):
    """What the rows of q (or of k) read and write, and how their flat row maps to (s, head, b)."""
    grad: object
    rstd: object
    normed: object
    out: object
    scale: object  # (1 + norm weight), fp32, this lane's columns
    sums: object  # this warp's fp32 sums of grad * normed
    heads: int

    def coord(self, row, by_seq):
        return row_coord(row, self.heads, by_seq=by_seq)


@cute.jit
def on_side(r, rows_q, total, sides, body):
    """body(side, row) for flat row r: q's row r, or k's row r - rows_q; nothing past total."""
    if r < rows_q:
        body(sides[0], r)
    else:
        if r < total:
            body(sides[1], r - rows_q)


class QkNormBackward:
    """dq, dk and the per-CTA partials of both norm-weight gradients (the caller adds them:
    the QKV backward's summed product does it in its idle warps, column_sum.ColumnSumsInWarps).

    `run` is the whole pass for the threads of one CTA, written as another kernel's prologue
    (the GEMM core's `prologue`: every CTA of the QKV backward's summed product's persistent
    grid, before its main loop). A Hopper GEMM CTA has 12 warps, against the 32 an SM of a
    kernel of its own, so each warp keeps several rows' loads in flight (the module's docstring
    has the measurements). The q rows go token-major: a token's heads on neighbouring warps,
    which write one contiguous run of dq."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.vectors = head_dim // VECTOR
        self.vectors_per_lane = -(-self.vectors // 32)

    def scratch_bytes(self, threads: int) -> int:
        """Shared memory `run` needs at least: one fp32 row of the head dim per warp for the
        partial rows."""
        return 4 * self.head_dim * (threads // 32)

    def ring_slots(self, threads: int, capacity: int) -> int:
        """Rows a warp stages in `capacity` bytes of scratch (grad and normed, bf16); under 2
        the ring would not overlap anything and the rows stay in registers."""
        slot = 2 * VECTOR * 32 * self.vectors_per_lane * STAGED * (threads // 32)
        return min(RING_SLOTS, capacity // slot)

    def arguments(self, grad_q, rstd_q, normed_q, weight_q, dq, grad_k, rstd_k, normed_k, weight_k, dk, cta_rows):
        """`run`'s arguments: per-head [b, heads, s, d] tensors as rows, dq/dk [b, s, heads, d]
        as rows in the same order, the partial rows [ctas, 2d]."""
        return ((head_rows(grad_q), head_rows(rstd_q), head_rows(normed_q), weight_q, token_rows(dq)),
                (head_rows(grad_k), head_rows(rstd_k), head_rows(normed_k), weight_k, token_rows(dk)), cta_rows)

    @cute.jit
    def run(self, args, scratch, capacity: int, tidx, threads: int):
        """This CTA's share of the rows, then its partial row. scratch: `capacity` bytes of
        shared memory (at least `scratch_bytes(threads)`), free for the call."""
        q, k, m_part = args
        g_q, r_q, n_q, w_q, o_q = q
        g_k, r_k, n_k, w_k, o_k = k
        warps = threads // 32
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
        heads = cute.size(g_q.shape[0][1])
        by_seq = cute.fast_divmod_create_divisor_v2(g_q.shape[0][0])
        # the rows' tensors and coordinates, q then k: row r of q is (q, r), of k (k, r - rows_q)
        sides = (Side(g_q, r_q, n_q, o_q, scale_q, sums_q, heads),
                 Side(g_k, r_k, n_k, o_k, scale_k, sums_k, 1))
        first, stride = bidx * warps + warp, ctas * warps
        ring_slots = self.ring_slots(threads, capacity)
        if cutlass.const_expr(ring_slots >= 2):
            self.rows_staged(atom, sides, rows_q, rows_k, by_seq, scratch, first, stride, lane, warp, warps,
                             ring_slots)
            cute.arch.barrier()  # the partial rows below reuse the other warps' rings
        else:
            self.rows_in_registers(atom, sides, rows_q, rows_k, by_seq, first, stride, lane)
        across = cute.make_tensor(cute.recast_ptr(scratch, dtype=Float32), cute.make_layout((self.head_dim, warps)))
        d = self.head_dim
        row = m_part[bidx, None]
        self.partial_row(sums_q, across, cute.make_tensor(row.iterator, cute.make_layout((d,))), lane, warp, tidx,
                         threads)
        self.partial_row(sums_k, across, cute.make_tensor(row.iterator + d, cute.make_layout((d,))), lane, warp,
                         tidx, threads)

    @cute.jit
    def rows_in_registers(self, atom, sides, rows_q, rows_k, by_seq, first, stride, lane):
        """This warp's rows r = first + n * stride, IN_FLIGHT at a time: their loads issued
        into registers, then each finished."""
        flight = IN_FLIGHT
        slots = self.row_slots(flight)
        at = cute.make_rmem_tensor((3, flight), Int32)  # each slot's row as (s, head, b), for its finish
        for batch in cutlass.range(first, rows_q + rows_k, stride * flight):
            for i in cutlass.range_constexpr(flight):
                r = batch + i * stride
                on_side(r, rows_q, rows_q + rows_k, sides, lambda side, row, i=i: self.load(
                    atom, side.grad, side.rstd, side.normed, self.hold(at, i, side.coord(row, by_seq)), lane,
                    *slots, i))
            for i in cutlass.range_constexpr(flight):
                r = batch + i * stride
                on_side(r, rows_q, rows_q + rows_k, sides, lambda side, row, i=i: self.finish(
                    atom, side.out, side.scale, side.sums, (at[0, i], at[1, i], at[2, i]), lane, *slots, i))

    @cute.jit
    def rows_staged(self, atom, sides, rows_q, rows_k, by_seq, scratch, first, stride, lane, warp, warps: int,
                    ring_slots: int):
        """This warp's rows r = first + n * stride through a ring of `ring_slots` rows in shared
        memory: row n + ring_slots - 1's loads go out (cp.async, 16 bytes a lane) before row n is
        finished, so a warp keeps loads in flight while it computes, without registers for
        them. Each lane reads back only the vectors it copied itself, so the wait is the
        lane's own (cp.async groups) and no warp barrier is needed."""
        vpl = self.vectors_per_lane
        ring = cute.make_tensor(cute.recast_ptr(scratch, dtype=BFloat16),
                                cute.make_layout((VECTOR, 32, vpl, STAGED, ring_slots, warps)))
        fill = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=16 * 8)
        slots = self.row_slots(1)
        rstd = cute.make_rmem_tensor((ring_slots,), Float32)
        at = cute.make_rmem_tensor((3, ring_slots), Int32)
        total = rows_q + rows_k
        rows = (total - first + stride - 1) // stride  # this warp's row count (<= 0: none)
        for j in cutlass.range_constexpr(ring_slots - 1):
            self.issue(fill, sides, rows_q, total, by_seq, first + j * stride, ring, rstd, at, j, lane, warp)
        for n0 in cutlass.range(0, rows, ring_slots):
            for j in cutlass.range_constexpr(ring_slots):
                n = n0 + j
                ahead = (j + ring_slots - 1) % ring_slots
                self.issue(fill, sides, rows_q, total, by_seq, first + (n + ring_slots - 1) * stride, ring, rstd,
                           at, ahead, lane, warp)
                cute.arch.cp_async_wait_group(ring_slots - 1)  # row n's group has landed
                on_side(first + n * stride, rows_q, total, sides, lambda side, row, j=j: self.finish_staged(
                    atom, side, ring, rstd, at, slots, j, lane, warp))
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def issue(self, fill, sides, rows_q, total, by_seq, r, ring, rstd, at, slot: int, lane, warp):
        """Row r's loads into ring slot `slot` (none past the last row), as one cp.async group."""
        on_side(r, rows_q, total, sides, lambda side, row: self.fill_slot(fill, side, row, by_seq, ring, rstd, at,
                                                                           slot, lane, warp))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def fill_slot(self, fill, side, row, by_seq, ring, rstd, at, slot: int, lane, warp):
        coord = self.hold(at, slot, side.coord(row, by_seq))
        rstd[slot] = side.rstd[coord, 0]
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            v = lane + 32 * j
            if v < self.vectors:
                for t, tensor in enumerate((side.grad, side.normed)):
                    cute.copy(fill, vector(tensor[coord, None], v), ring[None, lane, j, t, slot, warp])

    @cute.jit
    def finish_staged(self, atom, side, ring, rstd, at, slots, slot: int, lane, warp):
        """The row in ring slot `slot`: its vectors back into registers, then `finish`."""
        grad, normed, row_rstd = slots
        for v in cutlass.range_constexpr(self.vectors_per_lane):
            grad[None, v, 0].store(ring[None, lane, v, 0, slot, warp].load())
            normed[None, v, 0].store(ring[None, lane, v, 1, slot, warp].load())
        row_rstd[0] = rstd[slot]
        self.finish(atom, side.out, side.scale, side.sums, (at[0, slot], at[1, slot], at[2, slot]), lane, *slots, 0)

    def row_slots(self, flight: int):
        """Registers for `flight` rows: grad and normed as loaded (bf16), and rstd."""
        shape = (VECTOR, self.vectors_per_lane, flight)
        return (cute.make_rmem_tensor(shape, BFloat16), cute.make_rmem_tensor(shape, BFloat16),
                cute.make_rmem_tensor((flight,), Float32))

    @staticmethod
    def hold(at, i: int, coord):
        """Keep slot i's row coordinate for its finish; return it."""
        at[0, i], at[1, i], at[2, i] = coord
        return coord

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
    def load(self, atom, m_grad, m_rstd, m_normed, r, lane, grad, normed, rstd, i):
        """The loads of head row r (a `row_coord`) into in-flight slot i."""
        rstd[i] = m_rstd[r, 0]
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            v = lane + 32 * j
            if v < self.vectors:
                cute.copy(atom, vector(m_grad[r, None], v), grad[None, j, i])
                cute.copy(atom, vector(m_normed[r, None], v), normed[None, j, i])

    @cute.jit
    def finish(self, atom, m_out, scale, sums, r, lane, grad, normed, rstd, i):
        """Head row r (a `row_coord`) from slot i: out = bf16(rstd * (gn - n * sum(gn * n) / d)) with
        gn = fp32(bf16(grad * scale)); sums += grad * n."""
        staging = cute.make_rmem_tensor((VECTOR,), BFloat16)
        dot = Float32(0.0)
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            if lane + 32 * j < self.vectors:
                g = grad[None, j, i].load().to(Float32)
                n = normed[None, j, i].load().to(Float32)
                sums[None, j].store(sums[None, j].load() + g * n)
                dot += (self.scaled(g, scale, j) * n).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        dot = cute.arch.warp_reduction(dot, lambda a, b: a + b)
        s = rstd[i]
        coefficient = dot * (1.0 / self.head_dim)  # mean_d; exact as a product for d a power of two
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            v = lane + 32 * j
            if v < self.vectors:
                gn = self.scaled(grad[None, j, i].load().to(Float32), scale, j)
                staging.store(((gn - normed[None, j, i].load().to(Float32) * coefficient) * s).to(BFloat16))
                cute.copy(atom, staging, vector(m_out[r, None], v))

    @staticmethod
    def scaled(g, scale, j: int):
        """grad * (1 + norm weight) through bf16: the contract rounds it there, and the dot
        product and the output must see the same rounded values."""
        return (g * scale[None, j].load()).to(BFloat16).to(Float32)

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
