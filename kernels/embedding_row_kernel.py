"""The embedding + RMSNorm backward's row kernel (embedding_backward.py is the op): the norm
backward per token and the scatter-add of dx into the table, reading ids sorted on chip or
beforehand, and, in the one-launch build, the segment fix-up and the weight gradient's column sum
in its own grid.

Work split: the sorted positions are cut into `ctas` contiguous ranges, one per CTA. A CTA
walks its range one token row at a time (rows through a cp.async ring where they fit, as in
rmsnorm_backward), adds dx into a running fp32 segment sum, and writes a table row when a
segment (one id) ends: read-add-round with accumulate, plain round without. A segment cut by a
range boundary leaves fp32 partial rows instead (the tail of the range where it starts, the
head of every later range it covers); `SegmentFixup` then adds those partials in range order
and writes the row once. So one id shared by every token (the worst case) spreads over all CTAs
like random ids do, and its partials are summed by many CTAs, split over columns.
grad_norm_weight: per-CTA fp32 partials and the fixed-order `ColumnSum` (in the fix-up's
launch), which rounds the fp32 sum once as it stores a bf16 grad_norm_weight; no float atomics
anywhere.

Fresh tables are written whole by this kernel, each row once: after its walk every CTA zeroes
the rows of an even cut of [0, V) that no sorted id touches (marked in shared memory from the
sorted ids), so no fill precedes the kernels and nothing depends on the verdict being known
early. After the radix sort (the early_fill build) the CTAs fill while the sort's later passes
run, from a map of the touched rows and the ids' ranges that its first pass leaves
(table_fill.py), and the walking ones stop filling to walk once it has ended.

norm_weight's dtype (bf16 or fp32) is a compile-time fact of each build: the kernel reads it as
it is (8- or 16-byte vectors) and computes in fp32, and grad_norm_weight takes the same dtype.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import BFloat16, Float32, Int8, Int32, Int64, Uint32

from . import errors, id_radix, runtime
from .column_sum import add_column_slices
from .gemm.core import ARRIVALS_PER_USE
from .id_sort import MAX_TOKENS as SORT_ON_CHIP_MAX_TOKENS, report_bad_raw_ids, sort_ids
from .rows import (VECTOR, alloc_ring, cp_async_atoms, element, fake_rows, fake_rstd, fetch_row, read_row,
                   ring_stages, row_sum, rows_view, store_row, thread_index_again, thread_split, wide_copy)
from .segment_fixup import SegmentFixup, ids_in_range, owned_segment, range_start, segment_partial_row
from .table_fill import FILL_ROWS, TableFill

TARGET_VECTORS_PER_THREAD = 4  # H = 4096 -> 256 threads x 4 vectors
CTAS_PER_SM = 2  # 256 threads x 128 registers
# The row kernel's cp.async ring: the rows of the next sorted positions (grad_output, hidden_states
# and, with accumulate, the table row a segment ends in) load while this one is computed. Two
# CTAs per SM share the shared memory; H = 4096 gets 3 stages (96 KB with accumulate).
RING_BYTES = 104 * 1024
MAX_STAGES = 3
# Ids sorted beforehand are read through a shared-memory window of `threads` sorted positions
# (ids and tokens, one load a thread), moved on every threads - WINDOW_MARGIN positions: the
# loop's lookups (the token ahead, where a segment ends) cost no global round trip. The margin
# covers the ring's lookahead.
WINDOW_MARGIN = 8
# The one-launch build finishes without a co-residency guarantee (finish_in_grid): a CTA that has
# waited this many SM clock cycles (~0.5 ms) for the others to walk takes it that some never
# became resident, and leaves its finishing share to the last CTA to decide.
SETTLE_TIMEOUT_CYCLES = 1 << 20
# The finish's words past the published sorted ids: the arrival count, the decision count, then a
# status word per share (finish_in_grid).
ARRIVED, DECIDED, STATUS = 0, 1, 2



class EmbeddingRmsNormBackward:
    """`early_fill` (a fresh table's ids sorted beforehand): the build that fills while the radix
    sort runs (fill_early); a build of its own, since its code slowed the walk of the largest
    calls, which it does not serve (embedding_backward.EARLY_FILL_MAX_TOKENS).

    `one_launch` (accumulate, ids sorted on chip): the fix-up and the weight gradient's column
    sum run in the row kernel's own grid once every CTA has walked (finish_in_grid), so the call
    is one launch: small calls are bound by host time, ~3 us a launch. Not a cooperative launch,
    which would keep the next call's grid from starting beside this one (PDL), and finishing
    cannot hang where the grid is not co-resident."""

    def __init__(self, hidden: int, accumulate: bool, arch: str = "sm_90a", early_fill: bool = False,
                 one_launch: bool = False, model: bool = False, settle_timeout: int = SETTLE_TIMEOUT_CYCLES):
        if hidden % VECTOR:
            raise ValueError(f"hidden size {hidden} must be a multiple of {VECTOR}")
        self.hidden, self.accumulate, self.arch = hidden, accumulate, arch
        # The one-launch finish keeps the CTA's own segment sum and table row in registers from
        # the walk's end; under sm_100a's 128-register cap that spills, so there its share reads
        # both back as another CTA's would.
        self.own_in_registers = arch != "sm_100a"
        self.early_fill = early_fill and not accumulate
        self.one_launch = one_launch and accumulate
        self.model = model
        self.settle_timeout = settle_timeout
        self.threads, self.vectors_per_thread, self.warps = thread_split(hidden, TARGET_VECTORS_PER_THREAD)
        # a token's row bytes: grad_output bf16, hidden_states fp32 (the model form's bf16, with
        # the residual branch's bf16 gradient), the table row with accumulate
        row_bytes = hidden * (2 + (4 if not model else 2 + 2) + (2 if accumulate else 0))
        self.stages = ring_stages(row_bytes, RING_BYTES - 4 * MAX_STAGES * self.threads, MAX_STAGES)
        self.fixup = SegmentFixup(hidden, accumulate)
        self.table_fill = TableFill(hidden, self.threads, self.vectors_per_thread)

    @cute.jit
    def __call__(self, grad_output: cute.Tensor, hidden_states: cute.Tensor, rstd: cute.Tensor,
                 norm_weight: cute.Tensor, sorted_ids: cute.Tensor, order: cute.Tensor, table: cute.Tensor,
                 grad_norm_weight: cute.Tensor, workspace: cute.Tensor, marks: cute.Tensor, ranges: cute.Tensor,
                 ctas: Int32, grid: Int32, walker_rows: Int32, poison: Int32, marked: Int32,
                 stream: cuda.CUstream, residual_grad=None, embed_scale=None, padding=None):
        """The ids sorted beforehand (int32 sorted ids and their int64 order; the index pass
        records bad ids). Of `grid` CTAs the first `ctas` walk the sorted positions and all fill
        a fresh table (see `kernel`). `poison` (fresh tables): 1 where the outputs are the
        call's own, which bad ids fill with NaN; 0 where they are the caller's, which bad ids
        leave untouched. `marked` 1: the radix sort runs before this kernel with `mark` on, and
        `marks` and `ranges` are its (id_radix), so the fill starts before the sort ends. The
        model form's build (`model`) also takes the residual branch's gradient and the
        embedding's scale (embedding_norm_backward)."""
        self.launch(grad_output, hidden_states, rstd, norm_weight, sorted_ids, order, None, None, table,
                    grad_norm_weight, workspace, ctas, grid, walker_rows, poison, stream,
                    (marks, ranges, marked), model=(residual_grad, embed_scale, padding))

    @cute.jit
    def sort_on_chip(self, grad_output: cute.Tensor, hidden_states: cute.Tensor, rstd: cute.Tensor,
                     norm_weight: cute.Tensor, ids: cute.Tensor, sorted_ids: cute.Tensor, record: cute.Tensor,
                     table: cute.Tensor, grad_norm_weight: cute.Tensor, workspace: cute.Tensor, ctas: Int32,
                     grid: Int32, walker_rows: Int32, poison: Int32, stream: cuda.CUstream, residual_grad=None,
                     embed_scale=None, padding=None):
        """Up to SORT_ON_CHIP_MAX_TOKENS tokens: the raw ids (int64 or int32, [b, s], contiguous:
        the caller checks), each row-kernel CTA sorting them itself; CTA 0 leaves the sorted ids
        in `sorted_ids` (int32, at least as long) for the fix-up and bad ids' range in `record`
        (errors.py). With `one_launch` the words past those hold the finish's counts and a status
        word per CTA (finish_in_grid)."""
        # Read flat, as the [b, s] tensor itself: a reshape cost 2.6 us of host time a call.
        ids = cute.make_tensor(ids.iterator, cute.make_layout(cute.size(ids)))
        published = cute.make_tensor(sorted_ids.iterator, cute.make_layout(cute.size(ids)))
        arrivals = cute.make_tensor(sorted_ids.iterator + SORT_ON_CHIP_MAX_TOKENS, cute.make_layout(STATUS + ctas))
        self.launch(grad_output, hidden_states, rstd, norm_weight, published, None, ids, record, table,
                    grad_norm_weight, workspace, ctas, grid, walker_rows, poison, stream, arrivals=arrivals,
                    model=(residual_grad, embed_scale, padding))

    @cute.jit
    def launch(self, grad_output, hidden_states, rstd, norm_weight, sorted_ids, order, ids, record, table,
               grad_norm_weight, workspace, ctas, grid, walker_rows, poison, stream, radix=None, arrivals=None,
               model=(None, None, None)):
        """workspace rows: [0, ctas) grad_norm_weight partials (fp32 whatever its dtype); ctas + 2c
        and ctas + 2c + 1 the head and tail segment partials of range c; the last row's first
        element the id status (ColumnSum's `skip`: 0 in range, 1 bad ids, 2 bad ids with
        `poison`)."""
        h = self.hidden
        row_stride = cute.assume(workspace.stride[0], divby=VECTOR)
        partials = cute.make_tensor(workspace.iterator, cute.make_layout((ctas, h), stride=(row_stride, 1)))
        carries = cute.make_tensor(workspace.iterator + ctas * row_stride,
                                   cute.make_layout((2 * ctas, h), stride=(row_stride, 1)))
        status = cute.make_tensor(workspace.iterator + (workspace.shape[0] - 1) * row_stride, cute.make_layout(1))
        # A programmatic dependent of whatever ran before it (the radix sort's last pass): it
        # waits on griddepcontrol before reading anything but its inputs (and the radix
        # sort's marks, which have counters of their own).
        marks, ranges, marked = radix if radix is not None and self.early_fill else (None, None, Int32(0))
        finish = (grad_norm_weight, arrivals) if self.one_launch else (None, None)
        residual_grad, embed_scale, padding = model
        residual_rows = rows_view(residual_grad) if residual_grad is not None else None
        self.kernel(rows_view(grad_output), rows_view(hidden_states), rows_view(rstd)[None, 0], norm_weight,
                    sorted_ids, order, table, partials, carries, status, ids, record, marks, ranges, ctas,
                    walker_rows, poison, marked, *finish, residual_rows, embed_scale, padding).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True,
            **_occupancy(self.arch))
        if cutlass.const_expr(not self.one_launch):
            # The fix-up and grad_norm_weight's fixed-order sum (stored in its dtype), one launch;
            # it zeroes the marks for the next call.
            self.fixup(sorted_ids, table, carries, ctas, partials, grad_norm_weight, status, stream,
                       ids_ready=ids is None, zeroed=marks, padding=padding)

    @cute.kernel
    def kernel(self, m_go: cute.Tensor, m_x: cute.Tensor, m_rstd: cute.Tensor, m_w: cute.Tensor,
               m_sorted: cute.Tensor, m_order, m_table: cute.Tensor, m_part: cute.Tensor,
               m_carry: cute.Tensor, m_status: cute.Tensor, m_ids, m_record, m_marks, m_ranges, ctas: Int32,
               walker_rows: Int32, poison: Int32, marked: Int32, m_wout, m_arrivals, m_res, embed_scale, padding):
        """CTAs [0, ctas) walk ranges of the sorted positions (at least one each); every CTA of
        the grid fills its share of a fresh table, so a short call still fills with the whole
        GPU. Each CTA fills after its walk, so CTAs with short walks fill while others still
        walk (mark_rows); after the radix sort (`marked`) each CTA fills while the sort runs
        too (fill_early), and the walking ones stop to walk once it has ended."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane, warp = tidx % 32, tidx // 32
        h, vpt, threads = self.hidden, self.vectors_per_thread, self.threads
        vectors = h // VECTOR
        smem = cutlass.memory.SmemAllocator()
        loads = (wide_copy(BFloat16), wide_copy(Float32))
        norm_weight, grad_norm_weight, g, xs, segment, old = (cute.make_rmem_tensor((VECTOR, vpt), Float32)
                                                               for _ in range(6))
        for t in (norm_weight, grad_norm_weight, g, xs, segment, old):
            t.fill(0.0)
        touched, resume = None, None
        if cutlass.const_expr(m_marks is not None):
            # A bit per row of this CTA's share of a fresh table, set where an id touches it.
            touched = smem.allocate_tensor(Uint32, cute.make_layout(FILL_ROWS // 32), byte_alignment=16)
            resume = smem.allocate_tensor(Int32, cute.make_layout(threads + 1), byte_alignment=16)
        if cutlass.const_expr(m_ids is not None):
            # The index pass on chip: from here on the sorted ids and their order are shared
            # memory; CTA 0 publishes the sorted ids (m_sorted) for the fix-up kernel, where there
            # is one (not in one_launch).
            read_row(loads, (m_w,), (norm_weight,), tidx, threads, vpt, vectors)  # an input: before the wait
            # A fresh table's CTAs that only fill need no order: they mark their rows from the raw
            # ids (TableFill.mark_rows) and skip the sort, which reads only inputs before its
            # griddepcontrol wait (the last call's fix-up reads m_sorted).
            sort = Int32(1) if cutlass.const_expr(self.accumulate) else Int32(bidx < ctas)
            publish = Int32(0) if cutlass.const_expr(self.one_launch) else Int32(bidx == 0)  # for the fix-up
            in_range, m_sorted, m_order = sort_ids(smem, m_ids, m_table.shape[0], m_sorted, publish, tidx,
                                                   threads, sort)
            if cutlass.const_expr(self.one_launch):
                # The next kernel may launch now: a next call of this build sorts its ids (inputs
                # only, before its griddepcontrol wait) beside this grid's walk, which leaves an
                # SM's second CTA slot free.
                cute.arch.griddepcontrol_launch_dependents()
        else:
            read_row(loads, (m_w,), (norm_weight,), tidx, threads, vpt, vectors)  # an input: before the wait
            if cutlass.const_expr(m_marks is not None):
                if marked == 1:
                    self.table_fill.fill_early(touched, resume, m_table, m_marks, m_ranges, cute.size(m_sorted),
                                               poison, bidx, ctas, walker_rows, tidx)
            cute.arch.griddepcontrol_wait()  # the sorted ids and order are complete past this point
            in_range = ids_in_range(m_sorted, m_table.shape[0])
        tokens = cute.size(m_sorted)
        lo, hi = Int32(0), Int32(0)  # a filling CTA: no positions
        if bidx < ctas:
            lo, hi = range_start(bidx, tokens, ctas), range_start(bidx + 1, tokens, ctas)
        if bidx == 0 and tidx == 0:
            m_status[0] = Float32((1 - in_range) * (1 + poison))
            if cutlass.const_expr(m_ids is not None):
                if in_range == 0:
                    report_bad_raw_ids(m_record, m_ids, m_table.shape[0])
        if in_range == 0:
            hi = lo  # no rows, so no table writes (partials go to the workspace only)

        warp_sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2)), byte_alignment=16)
        # The sorted ids and tokens the loop reads, in shared memory: the on-chip sort's own, or
        # a window onto the global ones (window position = sorted position - base).
        ids_window, order_window, base = m_sorted, m_order, Int32(0)
        if cutlass.const_expr(m_ids is None):
            ids_window = smem.allocate_tensor(Int32, cute.make_layout(threads), byte_alignment=16)
            order_window = smem.allocate_tensor(Int32, cute.make_layout(threads), byte_alignment=16)
            base = lo
            _stage_window(m_sorted, m_order, base, ids_window, order_window, tidx)
            cute.arch.barrier()

        # The first segment began in an earlier range: its sum here is a head partial.
        head = Int32(0)
        if lo > 0:
            if m_sorted[lo - 1] == m_sorted[lo]:
                head = Int32(1)
        ring = self.stages
        # A token's rows: grad_output, hidden_states and, in a model form, the residual branch's gradient
        token_rows = (m_go, m_x) if cutlass.const_expr(m_res is None) else (m_go, m_x, m_res)
        if cutlass.const_expr(ring > 0):
            # Ring in shared memory, as in rmsnorm_backward: each thread copies and later reads only
            # its own vectors (and its own copy of rstd), so no barrier, one cp.async group per
            # position.
            rows_ring = alloc_ring(smem, token_rows + (m_table,) if cutlass.const_expr(self.accumulate) else token_rows,
                                   h, ring)
            rstd_ring = smem.allocate_tensor(Float32, cute.make_layout((threads, ring)), byte_alignment=16)
            fetches = cp_async_atoms()
            for j in cutlass.range_constexpr(ring - 1):
                if lo + j < hi:
                    self.fetch(fetches, token_rows, m_rstd, m_table, ids_window, Int32(order_window[lo + j - base]),
                               lo + j - base, rows_ring, rstd_ring, j, tidx)
                cute.arch.cp_async_commit_group()
        advance = threads - WINDOW_MARGIN
        for p in cutlass.range(lo, hi):
            if cutlass.const_expr(m_ids is None):
                if p - base == advance:
                    cute.arch.barrier()  # every thread is done with the window's first `advance` positions
                    base = p
                    _stage_window(m_sorted, m_order, base, ids_window, order_window, tidx)
                    cute.arch.barrier()
            if cutlass.const_expr(ring > 0):
                ahead = p + ring - 1
                token_ahead = Int32(0)
                if ahead < hi:
                    token_ahead = Int32(order_window[ahead - base])
                cute.arch.cp_async_wait_group(ring - 2)  # position p's group has landed
                slot = (p - lo) % ring
                rstd = rstd_ring[tidx, slot]
                read_row(loads, (rows_ring[0][None, slot], rows_ring[1][None, slot]), (g, xs), tidx, threads, vpt,
                         vectors)
                if cutlass.const_expr(m_res is not None):
                    # `old` holds the residual branch's gradient until a table row is written
                    read_row(loads, (rows_ring[2][None, slot],), (old,), tidx, threads, vpt, vectors)
            else:
                token = Int32(order_window[p - base])
                rstd = m_rstd[token]
                read_row(loads, (m_go[token, None], m_x[token, None]), (g, xs), tidx, threads, vpt, vectors)
                if cutlass.const_expr(m_res is not None):
                    read_row(loads, (m_res[token, None],), (old,), tidx, threads, vpt, vectors)
            vid = ids_window[p - base]
            dot = Float32(0.0)
            for k in cutlass.range_constexpr(vpt):
                gk, xk = g[None, k].load(), xs[None, k].load()
                grad_norm_weight[None, k].store(grad_norm_weight[None, k].load() + gk * (xk * rstd))
                dot += (gk * norm_weight[None, k].load() * xk).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            scale = rstd * rstd * row_sum(dot, warp_sums, (p - lo) % 2, lane, warp, self.warps) * (1.0 / h)
            for k in cutlass.range_constexpr(vpt):
                dx = rstd * (g[None, k].load() * norm_weight[None, k].load() - xs[None, k].load() * scale)
                if cutlass.const_expr(m_res is not None):
                    # the embedding's output feeds the norm and the residual branch; its scale
                    # multiplies the table row's gradient (summed per token: the same sum)
                    dx = (dx + old[None, k].load()) * embed_scale
                segment[None, k].store(segment[None, k].load() + dx)
            ends = _segment_ends(ids_window, p - base)
            if ends == 1:
                if head == 1:
                    store_row(loads[1], segment, m_carry[2 * bidx, None], tidx, threads, vpt, vectors)
                    head = Int32(0)
                else:
                    row = m_table[Int32(vid), None]
                    old_row = row
                    if cutlass.const_expr(ring > 0 and self.accumulate):
                        old_row = rows_ring[len(token_rows)][None, slot]
                    if _written(self.accumulate, segment, vid, padding) == 1:
                        _write_table_row(self.accumulate, loads[0], segment, old, row, tidx, threads, vpt, vectors,
                                         old_row)
                segment.fill(0.0)
            if cutlass.const_expr(ring > 0):
                # The slot refilled here held position p - 1, which this thread has already read.
                if ahead < hi:
                    self.fetch(fetches, token_rows, m_rstd, m_table, ids_window, token_ahead, ahead - base,
                               rows_ring, rstd_ring, (ahead - lo) % ring, tidx)
                cute.arch.cp_async_commit_group()  # possibly empty: keeps one group per position
        if cutlass.const_expr(self.arch == "sm_100a"):
            # Thread-derived addresses afresh: kept from before the walk they stay live across it,
            # past the 128 registers two CTAs an SM allow there.
            tidx = thread_index_again()
        # The last segment goes on past this range: hand its sum on as a partial.
        if hi < tokens and hi > lo:
            if m_sorted[hi] == m_sorted[hi - 1]:
                store_row(loads[1], segment, m_carry[2 * bidx + 1 - head, None], tidx, threads, vpt, vectors)
        if bidx < ctas:
            store_row(loads[1], grad_norm_weight, m_part[bidx, None], tidx, threads, vpt, vectors)
        if cutlass.const_expr(self.one_launch):
            if cutlass.const_expr(self.own_in_registers):
                # A segment this range owns (one that runs past its end): its table row read now, so
                # the grid wait covers the DRAM round trip. Only this CTA writes that row, in its finish.
                owns, vid, _ = owned_segment(m_sorted, m_table.shape[0], bidx, tokens, ctas)
                if owns == 1:
                    read_row((loads[0], loads[0]), (m_table[Int32(vid), None],), (old,), tidx, threads, vpt,
                             vectors)
            self.finish_in_grid(smem, m_sorted, m_table, m_part, m_carry, m_wout, padding, m_arrivals, ctas,
                                (segment, xs, old), loads, tidx)
        if cutlass.const_expr(not self.accumulate):
            # A fresh table is written whole, each row once (no fill beforehand): after its walk
            # each CTA fills its share of the rows no id touches (table_fill.py). After the walk, so
            # CTAs with short walks fill while others still walk (design-embedding.md).
            if cutlass.const_expr(m_ids is None):
                # Read again, not kept live across the walk: under sm_100a's 128-register cap
                # ptxas would spill the two ends to local memory.
                in_range = ids_in_range(m_sorted, m_table.shape[0])
            first, rows, value = self.table_fill.fill_share(m_table, in_range, poison, bidx, ctas, walker_rows)
            if cutlass.const_expr(m_marks is not None):
                marks = smem.allocate_tensor(Int8, cute.make_layout(FILL_ROWS), byte_alignment=16)
                bounds = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
                start = Int32(0)
                if marked == 1:
                    start = resume[tidx]  # fill_early's marks are still in `touched`
                else:
                    self.table_fill.mark_rows(touched, marks, bounds, m_sorted, m_ids, in_range, first, rows, tidx)
                self.table_fill.fill(m_table, touched, first, rows, value, tidx, start)
            else:
                touched = smem.allocate_tensor(Uint32, cute.make_layout(FILL_ROWS // 32), byte_alignment=16)
                marks = smem.allocate_tensor(Int8, cute.make_layout(FILL_ROWS), byte_alignment=16)
                bounds = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
                self.table_fill.mark_rows(touched, marks, bounds, m_sorted, m_ids, in_range, first, rows, tidx)
                self.table_fill.fill(m_table, touched, first, rows, value, tidx, 0)
        if cutlass.const_expr(not self.one_launch):
            # Let the fix-up launch now; its griddepcontrol.wait still waits for every write here.
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def finish_in_grid(self, smem, m_sorted, m_table, m_part, m_carry, m_wout, padding, m_words, ctas, regs, loads,
                       tidx):
        """SegmentFixup's two jobs in the row kernel's grid (`one_launch`) once every CTA has walked,
        as `ctas` shares (finish_share): share a adds the segment range a owns into its table
        row and a slice of the weight gradient's partial columns. m_words: the ARRIVED and
        DECIDED counts, never reset (each call adds ARRIVALS_PER_USE in all to each, as
        gemm.core.grid_barrier counts), and STATUS + a: target + 1 where share a was left.

        Each CTA arrives. The last to arrive claims its share at once; any other waits for the
        count to reach the call's target, then claims its share; past SETTLE_TIMEOUT_CYCLES (some
        CTA of the grid was never resident, held out by the waiting ones) it leaves the share
        and exits, which frees its SM for the CTAs still to run. Every CTA counts its decision,
        a CTA that leaves with ARRIVALS_PER_USE more, so the last to decide learns from its own
        count whether any share was left: then it does them, and takes the surplus back. Claiming
        costs no fence and no other word, so co-resident grids (the usual case) finish as after
        a grid barrier; none can hang. Bad ids write nothing."""
        bidx, _, _ = cute.arch.block_idx()
        decision = smem.allocate_tensor(Int32, cute.make_layout(3), byte_alignment=16)
        count = m_words.iterator
        share = Int32(1)
        if bidx == 0:
            share = Int32(ARRIVALS_PER_USE) - (ctas - 1)
        decided = Int32(0)  # thread 0: the decision count before this CTA's, read after its share
        cute.arch.barrier()  # this CTA's partials are written: thread 0's release below covers them
        if tidx == 0:
            found = cute.arch.atomic_add(count + ARRIVED, share, sem="acq_rel", scope="gpu")
            target = (found & Int32(-ARRIVALS_PER_USE)) + Int32(ARRIVALS_PER_USE)
            mine = Int32(1)
            if found + share != target:
                start = cute.arch.clock64()
                waiting = Int32(1)
                while waiting == 1:
                    if cute.arch.load(count + ARRIVED, Int32, sem="acquire", scope="gpu") - target >= 0:
                        waiting = Int32(0)
                    elif cute.arch.clock64() - start > self.settle_timeout:
                        waiting, mine = Int32(0), Int32(0)
            if mine == 0:
                m_words[STATUS + bidx] = target + 1
                cute.arch.fence_acq_rel_gpu()  # releases the status with the count below
            # One count for both, its result read only after the share: nothing waits on it here.
            decided = cute.arch.atomic_add(count + DECIDED, share + (1 - mine) * Int32(ARRIVALS_PER_USE),
                                           sem="relaxed", scope="gpu")
            decision[0] = mine
            decision[2] = target
        cute.arch.barrier()
        if decision[0] == 1:
            self.finish_share(bidx, m_sorted, m_table, m_part, m_carry, m_wout, padding, ctas, regs, loads, tidx,
                              self.own_in_registers)
        if tidx == 0:
            left = Int32(0)
            target = decision[2]
            decided += share + (1 - decision[0]) * Int32(ARRIVALS_PER_USE)
            surplus = decided - target  # ARRIVALS_PER_USE a share left, for the last to decide
            if (decided & Int32(ARRIVALS_PER_USE - 1)) == 0:
                if surplus != 0:
                    # Every CTA has decided, some left: after the acquire (and the count, for a
                    # CTA that left before it saw the count complete) their words are visible.
                    cute.arch.fence_acq_rel_gpu()
                    arriving = Int32(1)
                    while arriving == 1:
                        if cute.arch.load(count + ARRIVED, Int32, sem="acquire", scope="gpu") - target >= 0:
                            arriving = Int32(0)
                    cute.arch.atomic_add(count + DECIDED, -surplus, sem="relaxed", scope="gpu")
                    left = Int32(1)
            decision[1] = left
        cute.arch.barrier()
        if decision[1] == 1:
            for a in cutlass.range(ctas):
                if cute.arch.load(count + STATUS + a, Int32, sem="relaxed", scope="gpu") == decision[2] + 1:
                    self.finish_share(a, m_sorted, m_table, m_part, m_carry, m_wout, padding, ctas, regs, loads,
                                      tidx)
                    cute.arch.barrier()  # every thread has read the status before it is cleared
                    if tidx == 0:
                        m_words[STATUS + a] = Int32(0)  # never a later call's target + 1

    @cute.jit
    def finish_share(self, a, m_sorted, m_table, m_part, m_carry, m_wout, padding, ctas, regs, loads, tidx,
                     own: cutlass.Constexpr = False):
        """Share a of the finish: the segment range a owns, its partials in range order (range a's
        tail, then the heads of the ranges it reaches) added into the segment's table row, and
        slice a of the weight gradient's columns: a fixed order, the same bits whichever CTA does
        it. `own`: a is this CTA's range, whose tail partial is still in `segment` and whose
        segment's table row the walk's end read into `old`; another CTA reads both back. The first
        head is loaded before the column slice and added after it: the two wait on L2 together."""
        segment, staging, old = regs
        threads, vpt, vectors = self.threads, self.vectors_per_thread, self.hidden // VECTOR
        owns, vid, last_range = owned_segment(m_sorted, m_table.shape[0], a, cute.size(m_sorted), ctas)
        if cutlass.const_expr(not self.own_in_registers):
            # sm_100a: the column slice first, so no row is live across it (128 registers)
            if ids_in_range(m_sorted, m_table.shape[0]) == 1:
                add_column_slices(m_part, m_wout, threads, a)
        if owns == 1:
            if cutlass.const_expr(not own):
                read_row(loads, (m_carry[segment_partial_row(a, 0), None],), (segment,), tidx, threads, vpt, vectors)
                read_row((loads[0], loads[0]), (m_table[Int32(vid), None],), (old,), tidx, threads, vpt, vectors)
            # an owned segment runs past range a: range a + 1's head is always a partial
            read_row(loads, (m_carry[segment_partial_row(a, 1), None],), (staging,), tidx, threads, vpt, vectors)
        if cutlass.const_expr(self.own_in_registers):
            if ids_in_range(m_sorted, m_table.shape[0]) == 1:
                add_column_slices(m_part, m_wout, threads, a)
        if owns == 1:
            for j in cutlass.range(1, last_range - a + 1):
                if j > 1:
                    read_row(loads, (m_carry[segment_partial_row(a, j), None],), (staging,), tidx, threads, vpt,
                             vectors)
                for k in cutlass.range_constexpr(vpt):
                    segment[None, k].store(segment[None, k].load() + staging[None, k].load())
            if _written(True, segment, vid, padding) == 1:
                _add_into_row(loads[0], segment, old, m_table[Int32(vid), None], tidx, threads, vpt, vectors)

    @cute.jit
    def fetch(self, fetches, token_rows, m_rstd, m_table, ids, token, j, rows_ring, rstd_ring, slot, tidx):
        """cp.async the rows of the sorted position at `ids` index j into ring slot `slot`: this
        thread's vectors of the token's rows (`token_rows`: grad_output, hidden_states, ...), its
        own copy of the token's rstd and, with accumulate, the table row of the position's id
        where it ends its segment (read-add-write there)."""
        fetch_row(fetches, tuple(t[token, None] for t in token_rows), rows_ring, slot, tidx, self.threads,
                  self.vectors_per_thread, self.hidden // VECTOR)
        cute.copy(fetches[2], element(m_rstd, token), element(rstd_ring[tidx, None], slot))
        if cutlass.const_expr(self.accumulate):
            if _segment_ends(ids, j) == 1:
                fetch_row(fetches, (m_table[Int32(ids[j]), None],), rows_ring[len(token_rows):], slot, tidx,
                          self.threads, self.vectors_per_thread, self.hidden // VECTOR)


def _occupancy(arch: str) -> dict:
    """The launch's occupancy request: at sm_100a ptxas otherwise takes up to 140 registers, so
    two CTAs do not fit an SM; sm_90a's builds fit as compiled. (The carveout, shared memory's
    share of the SM's L1, is given so the DSL does not ask a device for it.)"""
    if arch == "sm_100a":
        return {"min_blocks_per_mp": CTAS_PER_SM, "preferred_smem_carveout": 100}
    return {}


@cute.jit
def _stage_window(m_sorted, m_order, base, ids_window, order_window, tidx):
    """Window position tidx = sorted position base + tidx: its id and token (past the last
    position, id -2, which no id equals, so the last segment ends where it should)."""
    vid, token = Int32(-2), Int32(0)
    if base + tidx < cute.size(m_sorted):
        vid = m_sorted[base + tidx]
        token = Int32(m_order[base + tidx])
    ids_window[tidx] = vid
    order_window[tidx] = token


@cute.jit
def _segment_ends(ids, j) -> Int32:
    """1 when the sorted position at index j of `ids` (the sorted ids or a window onto them) is
    the last of its segment."""
    ends = Int32(1)
    if j + 1 < cute.size(ids):
        if ids[j + 1] == ids[j]:
            ends = Int32(0)
    return ends


@cute.jit
def _written(accumulate: cutlass.Constexpr, segment, vid, padding) -> Int32:
    """Whether id vid's table row is written from `segment`: the model form's padding id gets no
    gradient (torch.nn.Embedding's padding_idx), so its row stays as it was with accumulate and
    is written as zeros in a fresh table (the fill skips rows ids touch)."""
    written = Int32(1)
    if cutlass.const_expr(padding is not None):
        if vid == padding:
            segment.fill(0.0)
            if cutlass.const_expr(accumulate):
                written = Int32(0)
    return written


@cute.jit
def _write_table_row(accumulate: cutlass.Constexpr, atom, segment, old, row, tidx, threads: cutlass.Constexpr,
                     vpt: cutlass.Constexpr, vectors: cutlass.Constexpr, old_row):
    """row = bf16(segment), or bf16(fp32(old_row) + segment) when accumulating (old_row: the
    table row itself or its copy in the ring): one rounding."""
    if cutlass.const_expr(accumulate):
        read_row((atom, atom), (old_row,), (old,), tidx, threads, vpt, vectors)
        _add_into_row(atom, segment, old, row, tidx, threads, vpt, vectors)
    else:
        store_row(atom, segment, row, tidx, threads, vpt, vectors)


@cute.jit
def _add_into_row(atom, segment, old, row, tidx, threads: cutlass.Constexpr, vpt: cutlass.Constexpr,
                  vectors: cutlass.Constexpr):
    """row = bf16(old + segment), `old` holding the row's values in fp32: one rounding."""
    for k in cutlass.range_constexpr(vpt):
        old[None, k].store(old[None, k].load() + segment[None, k].load())
    store_row(atom, old, row, tidx, threads, vpt, vectors)


def _fake_args(hidden: int, norm_weight_dtype, ids_dtype=None, model: bool = False):
    """Compile-time stand-ins: (the arguments before the stream, those after it). batch/seq
    shared by the [b, s, ...] tensors, tokens by the sorted ids and their order (or, with
    `ids_dtype`, by the raw ids, then followed by the sorted-ids buffer, any length, and the
    error record), vocabulary and workspace rows free; H static. norm_weight and
    grad_norm_weight in `norm_weight_dtype` (BFloat16 or Float32), vector aligned. `model`:
    hidden_states bf16, and after the stream the residual branch's gradient (bf16 rows) and the
    embedding's scale."""
    batch, seq, tokens = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    vocab, workspace_rows = cute.sym_int32(), cute.sym_int32()
    rstd = fake_rstd(batch, seq)
    norm_weight, grad_norm_weight = (runtime.fake_tensor(norm_weight_dtype, (hidden,), (1,),
                                                         VECTOR * norm_weight_dtype.width // 8) for _ in range(2))
    sorted_ids = runtime.fake_tensor(Int32, (tokens if ids_dtype is None else cute.sym_int32(),), (1,), 4)
    radix, marked = (), ()
    if ids_dtype is None:
        index = (sorted_ids, runtime.fake_tensor(Int64, (tokens,), (1,), 8))
        radix = (runtime.fake_tensor(Int32, (id_radix.MARK_WORDS + 2,), (1,), 16),
                 runtime.fake_tensor(Int64, (id_radix.MAX_CHUNKS, 2), (2, 1), 16))
        marked = (Int32(0),)
    else:
        ids = runtime.fake_tensor(ids_dtype, (batch, seq), (cute.sym_int64(), 1), ids_dtype.width // 8)
        index = (ids, sorted_ids, runtime.fake_tensor(Int64, (errors.WORDS,), (1,), 8))
    table = runtime.fake_tensor(BFloat16, (vocab, hidden), (cute.sym_int64(divisibility=VECTOR), 1), 8)
    workspace = runtime.fake_tensor(Float32, (workspace_rows, hidden), (cute.sym_int64(divisibility=VECTOR), 1), 16)
    x_dtype = BFloat16 if model else Float32
    extras = (fake_rows(BFloat16, batch, seq, hidden), Float32(1.0), Int32(-1)) if model else ()
    return (fake_rows(BFloat16, batch, seq, hidden), fake_rows(x_dtype, batch, seq, hidden), rstd, norm_weight,
            *index, table, grad_norm_weight, workspace, *radix, Int32(1), Int32(1), Int32(1), Int32(0), *marked), extras


def build(hidden: int, accumulate: bool, norm_weight_dtype, arch: str, dump_dir=None, ids_dtype=None,
          early_fill=False, model=False):
    """`norm_weight_dtype` (BFloat16 or Float32): norm_weight's and grad_norm_weight's. Without
    `ids_dtype` the kernels read ids sorted beforehand, as int32 whatever the input's id dtype
    (see the call); with it (Int64 or Int32) the raw ids, sorted on chip. `early_fill` and
    `model`: EmbeddingRmsNormBackward's."""
    # accumulating with ids sorted on chip: one launch (the calls are small); the finish's timeout
    # read at build time, so a test can build one that never waits
    op = EmbeddingRmsNormBackward(hidden, accumulate, arch, early_fill, one_launch=ids_dtype is not None,
                                  model=model, settle_timeout=SETTLE_TIMEOUT_CYCLES)
    args, extras = _fake_args(hidden, norm_weight_dtype, ids_dtype, model)
    key = ("embedding_rmsnorm_backward", hidden, accumulate, str(norm_weight_dtype), str(ids_dtype), early_fill)
    if ids_dtype is not None and accumulate:
        key += (("settle timeout", SETTLE_TIMEOUT_CYCLES),)
    return runtime.compile_kernel(key + (("model form",) if model else ()),
                                  op if ids_dtype is None else op.sort_on_chip, *args, runtime.env_stream(), *extras,
                                  arch=arch, dump_dir=dump_dir, tvm_ffi=True)
