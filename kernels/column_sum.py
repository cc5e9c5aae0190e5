"""Fixed-order column sums of fp32 partial rows: out[j] = sum_i partials[i, j].

The deterministic second half of a weight-gradient reduction: kernels write one fp32 partial
row per CTA (no float atomics), and this adds them in an order that depends only on the
partial count, so the result is bitwise repeatable run to run. The sum is fp32 throughout;
a bf16 `out` gets it rounded once, at the store.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32

from .rows import VECTOR, vector, wide_copy


# Partial rows a lane loads before adding them. The loads wait on L2 (the partials were just
# written by other CTAs): a loop that adds each row as it lands waits one round trip a row. Only
# add_column_slices walks enough rows a lane for this to pay. ColumnSum's 128 streams hold one to
# four rows each: there a batch's extra loads (the last row read again) cost the embedding fix-up
# more than the overlap saved.
ROWS_IN_FLIGHT = 4


@cute.jit
def add_rows(acc, partials: cute.Tensor, v, first, step):
    """acc += fp32 column vector v of partials' rows first, first + step, ... in that order (a
    fixed order: bitwise repeatable), ROWS_IN_FLIGHT loads issued before their adds so their
    round trips overlap."""
    atom = wide_copy(Float32)
    rows = partials.shape[0]
    staging = cute.make_rmem_tensor((VECTOR, ROWS_IN_FLIGHT), Float32)
    for i in cutlass.range(first, rows, step * ROWS_IN_FLIGHT):
        for j in cutlass.range_constexpr(ROWS_IN_FLIGHT):
            # every load unconditional (a row past the end reads the last row instead), so none
            # waits behind a branch or an earlier row's adds
            row = cutlass.min(i + j * step, rows - 1)
            cute.copy(atom, vector(partials[row, None], v), staging[None, j])
        for j in cutlass.range_constexpr(ROWS_IN_FLIGHT):
            if i + j * step < rows:  # a row past the end adds nothing (not even a zero: -0.0 stays)
                acc.store(acc.load() + staging[None, j].load())


class ColumnSum:
    """out[j] = sum_i partials[i, j], hidden a multiple of VECTOR; out fp32 or bf16 (its
    element type, fixed at compile time, picks the store).

    A CTA owns `line_vectors` column vectors (4: 64 bytes of each partial row) and spreads the
    partial rows over row_lanes x warps streams (row_lanes = 32 / line_vectors in each warp),
    stream s adding rows s, s + streams, ... in order. The streams combine by a butterfly within the warp, then
    warp 0 adds the warps in warp order. Many CTAs each walking a few rows: the ~300-500
    partial rows of a persistent grid cost two to four dependent loads a stream. Launched with programmatic
    dependent launch: it starts while the backward kernel drains and waits on griddepcontrol.
    With `skip` (a one-element fp32 tensor an earlier kernel writes): skip[0] == 0 stores the
    sums, 1 leaves out alone, 2 fills it with NaN: how the embedding backward writes nothing
    into a caller's output for out-of-range ids, and no plausible numbers into its own, without
    a host round trip.
    """

    # Half a 128-byte line per CTA: 160 CTAs at H = 2560, +0.5 point of copy bandwidth at the
    # fused residual RMSNorm backward's shortest grid calls against a full line (80 CTAs, longer
    # chains); a quarter line was in between.
    LINE_VECTORS = 4

    def __init__(self, hidden: int, warps: int = 16, line_vectors: int = LINE_VECTORS, adds: bool = False):
        """`warps` a CTA: 16 in a launch of its own; fewer as part of another kernel's grid
        (SegmentFixup's), whose CTA size it takes, with fewer `line_vectors` (a power of two up
        to 32) so each vector still gets as many streams. `adds`: out += the sums (out read as
        it is, the fp32 sum added, rounded once), for a gradient that accumulates in place."""
        self.hidden, self.warps, self.line_vectors, self.adds = hidden, warps, line_vectors, adds
        self.row_lanes = 32 // line_vectors
        self.ctas = -(-hidden // VECTOR // line_vectors)

    @cute.jit
    def __call__(self, partials: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream, skip=None):
        self.kernel(partials, out, skip).launch(grid=[self.ctas, 1, 1], block=[32 * self.warps, 1, 1],
                                                stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, m_part: cute.Tensor, m_out: cute.Tensor, m_skip):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        self.sum(m_part, m_out, m_skip, bidx, tidx)

    @cute.jit
    def sum(self, m_part: cute.Tensor, m_out: cute.Tensor, m_skip, bidx, tidx):
        """CTA `bidx`'s columns (of self.ctas), waiting on griddepcontrol for the partials."""
        lane, warp = tidx % 32, tidx // 32
        column, row_lane = lane % self.line_vectors, lane // self.line_vectors
        v = bidx * self.line_vectors + column
        streams = self.warps * self.row_lanes
        smem = cutlass.memory.SmemAllocator()
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout((VECTOR, self.line_vectors, self.warps)),
                                         byte_alignment=16)
        atom = wide_copy(Float32)
        acc = cute.make_rmem_tensor((VECTOR,), Float32)
        staging = cute.make_rmem_tensor((VECTOR,), Float32)
        acc.fill(0.0)
        cute.arch.griddepcontrol_wait()  # the partials are complete and visible past this point
        if v < self.hidden // VECTOR:
            for i in cutlass.range(warp * self.row_lanes + row_lane, m_part.shape[0], streams, unroll=4):
                cute.copy(atom, vector(m_part[i, None], v), staging)
                acc.store(acc.load() + staging.load())
        for offset in cutlass.range_constexpr(self.row_lanes.bit_length() - 1):
            for e in cutlass.range_constexpr(VECTOR):
                acc[e] = acc[e] + cute.arch.shuffle_sync_bfly(acc[e], self.line_vectors << offset)
        if row_lane == 0:
            warp_sums[None, column, warp].store(acc.load())
        cute.arch.barrier()
        skip = Float32(0.0)
        if cutlass.const_expr(m_skip is not None):
            skip = m_skip[0]
        if warp == 0 and row_lane == 0 and v < self.hidden // VECTOR and skip != 1.0:
            acc.fill(0.0)
            for w in cutlass.range_constexpr(self.warps):
                acc.store(acc.load() + warp_sums[None, column, w].load())
            if skip == 2.0:
                acc.fill(float("nan"))
            if cutlass.const_expr(self.adds):
                old = cute.make_rmem_tensor((VECTOR,), m_out.element_type)
                cute.copy(wide_copy(m_out.element_type), vector(m_out, v), old)
                acc.store(acc.load() + old.load().to(Float32))
            store_vector(acc, m_out, v)


class ColumnSumsInWarps:
    """The same fixed-order column sums as a side job of another kernel (the GEMM core's
    `side_job`: warps its main loop leaves idle), so they need no launch of their own (~4 us
    of host time a launch on the H200). Columns [0, split) go to out, the rest to out2.

    A warp owns a 16-byte column vector at a time (vectors dealt out over every CTA's side
    warps); its lanes take the partial rows lane, lane + 32, ... and combine by a butterfly.
    That order depends only on the row count, not on which warp or CTA does it: bitwise
    repeatable, and the same bits for any grid of the host kernel."""

    def __init__(self, columns: int, split: int):
        if columns % VECTOR or split % VECTOR:
            raise ValueError(f"columns and split must be multiples of {VECTOR}, got {columns}, {split}")
        self.columns, self.split = columns, split

    @cute.jit
    def run(self, args, warp, warps: int):
        """args = (partials [rows, columns] fp32, out [split] fp32, out2 [columns - split] fp32)."""
        partials, out, out2 = args
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        atom = wide_copy(Float32)
        acc = cute.make_rmem_tensor((VECTOR,), Float32)
        staging = cute.make_rmem_tensor((VECTOR,), Float32)
        for v in cutlass.range(bidx * warps + warp, self.columns // VECTOR, ctas * warps):
            acc.fill(0.0)
            for i in cutlass.range(lane, partials.shape[0], 32, unroll=4):
                cute.copy(atom, vector(partials[i, None], v), staging)
                acc.store(acc.load() + staging.load())
            for offset in cutlass.range_constexpr(5):
                for e in cutlass.range_constexpr(VECTOR):
                    acc[e] = acc[e] + cute.arch.shuffle_sync_bfly(acc[e], 1 << offset)
            if lane == 0:
                if v < self.split // VECTOR:
                    cute.copy(atom, acc, vector(out, v))
                else:
                    cute.copy(atom, acc, vector(out2, v - self.split // VECTOR))


@cute.jit
def add_column_slices(partials: cute.Tensor, out: cute.Tensor, threads: cutlass.Constexpr, cta=None):
    """out = the column sums of fp32 partials [rows, columns] (out fp32, or bf16 rounded once), by
    every CTA of the grid, each adding a slice of the columns: a vector's rows go to `lanes`
    adjacent lanes of a warp (a power of two up to 32: as many as the slice leaves each vector),
    lane l adding rows l, l + lanes, ... in order (add_rows: four rows' loads in flight at a
    time), then a butterfly over the lanes. The order depends only on the grid and the row
    count: bitwise repeatable. `cta`: whose slice (this CTA's by default)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    if cutlass.const_expr(cta is not None):
        bidx = cta
    ctas, _, _ = cute.arch.grid_dim()
    vectors = partials.shape[1] // VECTOR
    per_cta = (vectors + ctas - 1) // ctas
    lanes = Int32(32)
    while lanes > 1 and lanes * per_cta > threads:
        lanes = lanes // 2
    slot, row_lane, slots = tidx // lanes, tidx % lanes, threads // lanes
    acc = cute.make_rmem_tensor((VECTOR,), Float32)
    for first in cutlass.range(0, per_cta, slots):  # the same trip count in every lane: shuffles below
        s = first + slot
        v = bidx * per_cta + s
        acc.fill(0.0)
        if s < per_cta and v < vectors:
            add_rows(acc, partials, v, row_lane, lanes)
        for offset in cutlass.range_constexpr(5):
            if (1 << offset) < lanes:
                for e in cutlass.range_constexpr(VECTOR):
                    acc[e] = acc[e] + cute.arch.shuffle_sync_bfly(acc[e], 1 << offset)
        if row_lane == 0 and s < per_cta and v < vectors:
            store_vector(acc, out, v)


@cute.jit
def store_vector(acc, out, v):
    """fp32 `acc` into vector v of `out`, in out's element type: the one rounding of a bf16 out."""
    result = cute.make_rmem_tensor((VECTOR,), out.element_type)
    result.store(acc.load().to(out.element_type))
    cute.copy(wide_copy(out.element_type), result, vector(out, v))
