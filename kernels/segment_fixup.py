"""The embedding backward's work split and the fix-up of the segments it cuts: the sorted
positions go to `ctas` contiguous ranges, one per row-kernel CTA; a segment (one id's tokens)
that crosses a range boundary leaves fp32 partial rows, which `SegmentFixup` adds in range order
into the table.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import BFloat16, Float32, Int32, Int64

from .column_sum import ColumnSum
from .rows import VECTOR, vector, wide_copy


def range_start(c, tokens, ctas):
    """First sorted position of range c: floor(c * T / ctas), in 64-bit (c * T may pass 2^31)."""
    return Int32((Int64(c) * Int64(tokens)) // Int64(ctas))


@cute.jit
def ids_in_range(m_sorted, vocab) -> Int32:
    """1 when every id lies in [0, vocab): the sorted ends do."""
    ok = Int32(0)
    if m_sorted[0] >= 0 and m_sorted[cute.size(m_sorted) - 1] < vocab:
        ok = Int32(1)
    return ok


@cute.jit
def owned_segment(m_sorted, vocab, a, tokens, ctas):
    """(owns, id, last range) for range a of `ctas` over the sorted ids: the segment that starts
    in range a and runs past its end, if any (its id and the last range it reaches), which the
    fix-up of range a adds up; (0, 0, a + 1) where there is none or an id is out of range.
    Random ids make short segments, which end in the next range: one load says so. Only a
    segment that runs past it (one id on many tokens) pays the binary search for the first id
    above it, ~log2(T) dependent loads."""
    lo, hi = range_start(a, tokens, ctas), range_start(a + 1, tokens, ctas)
    owns = Int32(0)
    if hi < tokens and ids_in_range(m_sorted, vocab) == 1:
        if m_sorted[hi] == m_sorted[hi - 1]:
            owns = Int32(1)
            if lo > 0:
                if m_sorted[lo - 1] == m_sorted[hi - 1]:
                    owns = Int32(0)  # it started in an earlier range, whose fix-up adds it up
    vid, last_range = Int32(0), a + 1
    if owns == 1:
        vid = m_sorted[hi - 1]
        next_hi = range_start(a + 2, tokens, ctas)
        if next_hi < tokens:
            if m_sorted[next_hi] == vid:
                left, right = next_hi, tokens
                for _ in cutlass.range_constexpr(32):
                    if left < right:
                        mid = (left + right) // 2
                        if m_sorted[mid] > vid:
                            right = mid
                        else:
                            left = mid + 1
                last_range = Int32((Int64(left) * Int64(ctas) + Int64(tokens) - 1) // Int64(tokens)) - 1
    return owns, vid, last_range


@cute.jit
def segment_partial_row(a, j):
    """The carries row holding partial j of the segment range a owns, in the order they are
    added: range a's tail (row 2a + 1) for j = 0, then the head of range a + j (row 2(a + j))."""
    row = 2 * (a + j) + 1
    if j > 0:
        row = 2 * (a + j)
    return row


class SegmentFixup:
    """Table rows of segments cut by range boundaries: the tail partial of the range where the
    segment starts plus the head partials of the ranges it reaches, added in range order.

    Grid (ranges, column blocks): CTA (a, b) owns the segment that starts in range a and runs
    past it (most CTAs own nothing and exit), and LINE_VECTORS column vectors of it,
    LANE_VECTORS a lane. Its warps split the partial rows round-robin; then warp w adds the
    warps' sums of each lane's w-th vector in warp order: a fixed order. Few CTAs own anything,
    so the grid's size is most of the kernel's time: four vectors a lane launch a quarter of
    the CTAs that one did (8448 -> 2112 for 264 ranges at H = 4096).

    Launched as the row kernel's programmatic dependent: where the sorted ids were there before
    the row kernel (`ids_ready`), ownership (a chain of dependent loads) is worked out while the
    row kernel drains, and only the partials and table rows wait on griddepcontrol. Every CTA
    waits, owner or not, so the fix-up never completes before the row kernel.

    The same launch runs a ColumnSum of the row kernel's weight-gradient partials in CTAs of
    its own after the fix-up's (the two jobs are independent): one launch less a call, ~4 us
    of host time on the H200, where calls of a few hundred tokens are host-bound.
    """

    WARPS = 4
    LANE_VECTORS = 4  # one per warp in the final sum
    LINE_VECTORS = 32 * LANE_VECTORS

    def __init__(self, hidden: int, accumulate: bool):
        self.hidden, self.accumulate = hidden, accumulate
        self.column_blocks = -(-hidden // VECTOR // self.LINE_VECTORS)
        self.column_sum = ColumnSum(hidden, warps=self.WARPS, line_vectors=1)

    @cute.jit
    def __call__(self, sorted_ids: cute.Tensor, table: cute.Tensor, carries: cute.Tensor, ctas: Int32,
                 partials: cute.Tensor, grad_weight: cute.Tensor, skip: cute.Tensor, stream: cuda.CUstream,
                 ids_ready: cutlass.Constexpr = True, zeroed=None, padding=None):
        """The fix-up of `ctas` ranges, and grad_weight = the column sums of `partials` (skip:
        ColumnSum's); `zeroed` (int32, optional) is zeroed once the kernel before has ended;
        `padding` (optional): an id whose row gets no gradient (the row kernel's `_written`)."""
        self.kernel(sorted_ids, table, carries, ctas, partials, grad_weight, skip, zeroed, padding, ids_ready).launch(
            grid=[ctas * self.column_blocks + self.column_sum.ctas, 1, 1], block=[32 * self.WARPS, 1, 1],
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, m_sorted: cute.Tensor, m_table: cute.Tensor, m_carry: cute.Tensor, ctas: Int32,
               m_part: cute.Tensor, m_weight: cute.Tensor, m_skip: cute.Tensor, m_zeroed, padding,
               ids_ready: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        fixups = ctas * self.column_blocks
        if bidx < fixups:
            self.fix(m_sorted, m_table, m_carry, ids_ready, bidx // self.column_blocks, bidx % self.column_blocks,
                     ctas, padding, tidx)
        else:
            self.column_sum.sum(m_part, m_weight, m_skip, bidx - fixups, tidx)  # waits on griddepcontrol
            if cutlass.const_expr(m_zeroed is not None):
                grid, _, _ = cute.arch.grid_dim()
                if bidx == grid - 1:
                    for i in cutlass.range(tidx, cute.size(m_zeroed), 32 * self.WARPS):
                        m_zeroed[i] = Int32(0)

    @cute.jit
    def fix(self, m_sorted: cute.Tensor, m_table: cute.Tensor, m_carry: cute.Tensor, ids_ready: cutlass.Constexpr,
            a, column_block, ctas, padding, tidx):
        """The segment range a owns, if any: its columns of column block `column_block`. The
        padding id's row (if any) stays as it was with accumulate, and is written as zeros in a
        fresh table."""
        lane, warp = tidx % 32, tidx // 32
        tokens = cute.size(m_sorted)
        smem = cutlass.memory.SmemAllocator()
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout((VECTOR, self.LANE_VECTORS, 32, self.WARPS)),
                                         byte_alignment=16)
        f32 = wide_copy(Float32)
        first = column_block * self.LINE_VECTORS + lane  # this lane's vectors: first + 32 i
        vectors = self.hidden // VECTOR
        if cutlass.const_expr(not ids_ready):
            cute.arch.griddepcontrol_wait()  # the row kernel's CTA 0 publishes the sorted ids
        owns, vid, last_range = owned_segment(m_sorted, m_table.shape[0], a, tokens, ctas)
        if cutlass.const_expr(ids_ready):
            cute.arch.griddepcontrol_wait()  # the partials and table rows are written past this point
        zero = Int32(0)
        if cutlass.const_expr(padding is not None):
            if vid == padding:
                zero = Int32(1)
                if cutlass.const_expr(self.accumulate):
                    owns = Int32(0)
        if owns == 1:
            acc = cute.make_rmem_tensor((VECTOR, self.LANE_VECTORS), Float32)
            staging = cute.make_rmem_tensor((VECTOR,), Float32)
            acc.fill(0.0)
            for j in cutlass.range(warp, last_range - a + 1, self.WARPS, unroll=2):
                row = segment_partial_row(a, j)
                for i in cutlass.range_constexpr(self.LANE_VECTORS):
                    if first + 32 * i < vectors:
                        cute.copy(f32, vector(m_carry[row, None], first + 32 * i), staging)
                        acc[None, i].store(acc[None, i].load() + staging.load())
            for i in cutlass.range_constexpr(self.LANE_VECTORS):
                warp_sums[None, i, lane, warp].store(acc[None, i].load())
            cute.arch.barrier()
            v = first + 32 * warp  # warp w finishes each lane's w-th vector
            if v < vectors:
                total = cute.make_rmem_tensor((VECTOR,), Float32)
                total.fill(0.0)
                for w in cutlass.range_constexpr(self.WARPS):
                    total.store(total.load() + warp_sums[None, warp, lane, w].load())
                row = m_table[Int32(vid), None]
                out = cute.make_rmem_tensor((VECTOR,), BFloat16)
                bf16 = wide_copy(BFloat16)
                if cutlass.const_expr(self.accumulate):
                    cute.copy(bf16, vector(row, v), out)
                    total.store(total.load() + out.load().to(Float32))
                if zero == 1:  # a fresh table's padding row
                    total.fill(0.0)
                out.store(total.load().to(BFloat16))
                cute.copy(bf16, out, vector(row, v))
