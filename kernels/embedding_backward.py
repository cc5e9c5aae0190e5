"""The embedding lookup + RMSNorm backward: the norm backward and a deterministic
scatter-add of dx into the [V, H] bf16 embedding-gradient table, one FFI call.

    w = f32(norm_weight)   (norm_weight bf16 as the contract has it, or fp32)
    dx_t = rstd_t * (g_t * w - x_t * rstd_t^2 * sum_j(g_tj w_j x_tj) / H)
    table[v] = bf16( [table[v] +] sum over tokens t with id v of dx_t )   (fp32 sum, one rounding)
    grad_norm_weight = sum over tokens of g_t * x_t * rstd_t   (fp32 sum, one rounding to norm_weight's dtype)

Index pass: a stable sort of the ids gives the tokens grouped by id, each group in token
order, which fixes the order of every fp32 sum: bitwise repeatable. Up to
SORT_ON_CHIP_MAX_TOKENS tokens every row-kernel CTA sorts the raw ids in its shared memory
(id_sort.py: no sort launches, no host work); above, an index pass (below).

Id check, on the device, with no host synchronization (docs/design-embedding.md): the verdict
rides with the sorted ids, so every kernel refuses bad ids before it writes anything.
- Ids sorted on chip: each row-kernel CTA sees bad ids as it sorts; CTA 0 records their range
  in the device's error record (errors.py) and leaves the verdict in a status word for the
  column sum.
- Sorted beforehand: the index pass (our radix sort up to id_radix.MAX_TOKENS tokens and 2^24
  ids, on two digits up to 65536 ids and three above; RangeAndKeys, PyTorch's sort of int16
  keys and WidenKeys above that many tokens; PyTorch's operations beyond) writes -1 as the
  first sorted id when an id is bad, and records the range; the kernels check the sorted ends.
With bad ids a caller's outputs are left untouched and the call's own are filled with NaN.
The host learns of the error at its next call (errors.raise_pending), or at once with
check_ids="now", which synchronizes.

Fresh tables are written whole by the row kernel, each row once: after its walk every CTA
zeroes the rows of an even cut of [0, V) that no sorted id touches (marked in shared memory
from the sorted ids), so no fill precedes the kernels and nothing depends on the verdict being
known early. After our radix sort (up to EARLY_FILL_MAX_TOKENS tokens) the CTAs fill while the
sort's later passes run, from a map of the touched rows and the ids' ranges that its first pass
leaves (table_fill.py), and the walking ones stop filling to walk once it has ended.

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

norm_weight's dtype (bf16 or fp32) is a compile-time fact of each build: the row kernel reads
it as it is (8- or 16-byte vectors) and computes in fp32, and grad_norm_weight takes the same
dtype.
"""
from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import BFloat16, Float32, Int8, Int32, Int64, Uint32

from . import errors, id_radix, runtime
from .calls import KEY_ERRORS, CallCache
from .column_sum import add_column_slices
from .gemm.core import ARRIVALS_PER_USE
from .segment_fixup import SegmentFixup, ids_in_range, owned_segment, range_start, segment_partial_row
from .table_fill import FILL_ROWS, TableFill
from .id_sort import KEYS_MAX_VOCAB, RangeAndKeys, WidenKeys, build_range_and_keys, build_widen_keys, sort_ids
from .id_sort import report_bad_raw_ids
from .id_sort import MAX_TOKENS as SORT_ON_CHIP_MAX_TOKENS, MAX_VOCAB as SORT_ON_CHIP_MAX_VOCAB
from .rows import (MAX_HIDDEN, VECTOR, alloc_ring, cp_async_atoms, element, fake_rows, fake_rstd, fetch_row,
                   read_row, ring_stages, row_sum, rows_view, store_row, thread_index_again, thread_split,
                   wide_copy)

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
# A fresh table's fill starts during the radix sort (the early_fill build) up to
# EARLY_FILL_MAX_TOKENS tokens (H200, us, same run: 1688 tokens 161.0 -> 158.6, 4096 181.8 ->
# 177.3, 8192 205.7 -> 203.0). Larger calls, whose walk sets their end, keep the plain build: the
# early fill there was measured only in one build with the rest, whose code slowed their walk.
EARLY_FILL_MAX_TOKENS = 12288
# The one-launch build finishes without a co-residency guarantee (finish_in_grid): a CTA that has
# waited this many SM clock cycles (~0.5 ms) for the others to walk takes it that some never
# became resident, and leaves its finishing share to the last CTA to arrive.
SETTLE_TIMEOUT_CYCLES = 1 << 20
# A share's status word before its CTA decides: never a generation's target (a multiple of
# ARRIVALS_PER_USE, "claimed") or target + 1 ("left to the last CTA").
PENDING = 2


class EmbeddingRmsNormBackward:
    """`early_fill` (a fresh table's ids sorted beforehand): the build that fills while the radix
    sort runs (fill_early); a build of its own, since its code slowed the walk of the largest
    calls, which it does not serve (EARLY_FILL_MAX_TOKENS).

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
        (errors.py). With `one_launch` the words past those hold the finish's arrival count and
        a status word per CTA (finish_in_grid)."""
        # Read flat, as the [b, s] tensor itself: a reshape cost 2.6 us of host time a call.
        ids = cute.make_tensor(ids.iterator, cute.make_layout(cute.size(ids)))
        published = cute.make_tensor(sorted_ids.iterator, cute.make_layout(cute.size(ids)))
        arrivals = cute.make_tensor(sorted_ids.iterator + SORT_ON_CHIP_MAX_TOKENS, cute.make_layout(ctas + 1))
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
        row and a slice of the weight gradient's partial columns. m_words: [0] the arrival count
        (never reset: each call adds ARRIVALS_PER_USE in all, as gemm.core.grid_barrier counts),
        [1 + a] share a's status.

        Each CTA marks its share pending and arrives. The last to arrive does its share, then
        every share whose CTA left it. Any other CTA waits for the count to reach the call's
        target: then it claims its share and does it; past SETTLE_TIMEOUT_CYCLES (some CTA of
        the grid was never resident, held out by the waiting ones) it leaves the share and
        exits, which frees its SM for the CTAs still to run. Co-resident grids (the usual case)
        finish as after a grid barrier; none can hang. Bad ids write nothing."""
        bidx, _, _ = cute.arch.block_idx()
        decision = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        count = m_words.iterator
        cute.arch.barrier()  # this CTA's partials are written: thread 0's release below covers them
        if tidx == 0:
            m_words[1 + bidx] = Int32(PENDING)
            share = Int32(1)
            if bidx == 0:
                share = Int32(ARRIVALS_PER_USE) - (ctas - 1)
            found = cute.arch.atomic_add(count, share, sem="acq_rel", scope="gpu")
            target = (found & Int32(-ARRIVALS_PER_USE)) + Int32(ARRIVALS_PER_USE)
            last = Int32(found + share == target)
            mine = Int32(1)
            if last == 0:
                start = cute.arch.clock64()
                waiting = Int32(1)
                while waiting == 1:
                    if cute.arch.load(count, Int32, sem="acquire", scope="gpu") - target >= 0:
                        waiting = Int32(0)
                    elif cute.arch.clock64() - start > self.settle_timeout:
                        waiting, mine = Int32(0), Int32(0)
                cute.arch.store(count + 1 + bidx, target + 1 - mine, sem="release", scope="gpu")
            decision[0] = mine
            decision[1] = last
            decision[2] = target
        cute.arch.barrier()
        mine, last, target = decision[0], decision[1], decision[2]
        if mine == 1:
            self.finish_share(bidx, m_sorted, m_table, m_part, m_carry, m_wout, padding, ctas, regs, loads, tidx)
        if last == 1:
            # The shares other CTAs left: each thread reads the status of shares tidx, tidx +
            # threads, ... (every CTA has arrived, so each is decided or about to be).
            for first in cutlass.range(0, ctas, self.threads):
                a = first + tidx
                left = Int32(0)
                if a < ctas and a != bidx:
                    undecided = Int32(1)
                    while undecided == 1:
                        status = cute.arch.load(count + 1 + a, Int32, sem="acquire", scope="gpu")
                        if status - target == 0:
                            undecided = Int32(0)
                        elif status - target == 1:
                            undecided, left = Int32(0), Int32(1)
                cute.arch.barrier()
                if tidx == 0:
                    decision[3] = Int32(0)
                cute.arch.barrier()
                if left == 1:
                    decision[3] = Int32(1)  # every writer writes 1
                cute.arch.barrier()
                if decision[3] == 1:
                    for j in cutlass.range(self.threads):
                        if first + j < ctas:
                            if cute.arch.load(count + 1 + first + j, Int32, sem="acquire", scope="gpu") - target == 1:
                                self.finish_share(first + j, m_sorted, m_table, m_part, m_carry, m_wout, padding,
                                                  ctas, regs, loads, tidx)

    @cute.jit
    def finish_share(self, a, m_sorted, m_table, m_part, m_carry, m_wout, padding, ctas, regs, loads, tidx):
        """Share a of the finish: the segment range a owns, its partials in range order, added into
        the segment's table row, and slice a of the weight gradient's columns (a fixed order:
        the same bits whichever CTA does it)."""
        segment, staging, old = regs
        threads, vpt, vectors = self.threads, self.vectors_per_thread, self.hidden // VECTOR
        owns, vid, last_range = owned_segment(m_sorted, m_table.shape[0], a, cute.size(m_sorted), ctas)
        if owns == 1:
            segment.fill(0.0)
            for j in cutlass.range(last_range - a + 1):
                read_row(loads, (m_carry[segment_partial_row(a, j), None],), (staging,), tidx, threads, vpt,
                         vectors)
                for k in cutlass.range_constexpr(vpt):
                    segment[None, k].store(segment[None, k].load() + staging[None, k].load())
            row = m_table[Int32(vid), None]
            if _written(True, segment, vid, padding) == 1:
                _write_table_row(True, loads[0], segment, old, row, tidx, threads, vpt, vectors, row)
        if ids_in_range(m_sorted, m_table.shape[0]) == 1:
            add_column_slices(m_part, m_wout, threads, a)

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
        for k in cutlass.range_constexpr(vpt):
            old[None, k].store(old[None, k].load() + segment[None, k].load())
        store_row(atom, old, row, tidx, threads, vpt, vectors)
    else:
        store_row(atom, segment, row, tidx, threads, vpt, vectors)


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


def _build(hidden: int, accumulate: bool, norm_weight_dtype, arch: str, dump_dir=None, ids_dtype=None,
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


def _check_inputs(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size):
    import torch

    from .checks import check_hidden_size, check_row_strides, check_same_device, check_tensor

    check_tensor("grad_output", grad_output, dtypes=torch.bfloat16, ndim=3, contiguous=False, align=8)
    batch, seq, hidden = grad_output.shape
    check_hidden_size("grad_output", hidden, MAX_HIDDEN)
    check_tensor("input_ids", input_ids, dtypes=(torch.int64, torch.int32), shape=(batch, seq),
                 contiguous=False, align=1)
    check_tensor("hidden_states", hidden_states, dtypes=torch.float32, shape=(batch, seq, hidden), contiguous=False)
    for name, t in (("grad_output", grad_output), ("hidden_states", hidden_states)):
        check_row_strides(name, t, VECTOR)
    check_tensor("rstd", rstd, dtypes=torch.float32, shape=(batch, seq, 1), contiguous=False, align=4)
    check_tensor("norm_weight", norm_weight, dtypes=(torch.bfloat16, torch.float32), shape=(hidden,),
                 align=_vector_bytes(norm_weight))
    check_same_device(grad_output=grad_output, input_ids=input_ids, hidden_states=hidden_states, rstd=rstd,
                      norm_weight=norm_weight)
    if not isinstance(vocab_size, int) or not 0 < vocab_size < 2**31:
        raise ValueError(f"vocab_size: expected a positive int below 2^31, got {vocab_size!r}")
    if batch * seq >= 2**31:
        raise ValueError(f"grad_output: {batch * seq} tokens; at most 2^31 - 1 are supported")
    return batch, seq, hidden


def _check_out(out, hidden_states, norm_weight, vocab_size):
    """out = (grad_embed_weight, grad_norm_weight), the latter in norm_weight's dtype
    (norm_weight's own checks come first: _check_inputs, or an entry key made after them)."""
    import torch

    from .checks import check_same_device, check_tensor

    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out: expected (grad_embed_weight, grad_norm_weight)")
    hidden = hidden_states.shape[-1]
    check_tensor("out[grad_embed_weight]", out[0], dtypes=torch.bfloat16, shape=(vocab_size, hidden), align=8)
    check_tensor("out[grad_norm_weight]", out[1], dtypes=norm_weight.dtype, shape=(hidden,),
                 align=_vector_bytes(norm_weight))
    check_same_device(hidden_states=hidden_states, grad_embed_weight=out[0], grad_norm_weight=out[1])
    return tuple(out)


def _vector_bytes(norm_weight) -> int:
    """The alignment the kernels' vector accesses of norm_weight and grad_norm_weight need:
    VECTOR elements, 8 bytes in bf16, 16 in fp32 (and anything else, which fails the dtype check)."""
    import torch

    return VECTOR * (2 if getattr(norm_weight, "dtype", None) == torch.bfloat16 else 4)


class _Entry:
    """What one (hidden size, accumulate, ids dtype, norm_weight dtype, device, form) needs per
    call, resolved once. Each path's kernels are built on the path's first call (a call size uses
    two to four of the builds)."""

    def __init__(self, hidden: int, accumulate: bool, ids_dtype, norm_weight_dtype, device, model: bool = False):
        import torch

        self.device, self.hidden, self.accumulate, self.model = device, hidden, accumulate, model
        self.device_index = device.index
        self.norm_weight = runtime.cute_dtype(norm_weight_dtype)
        self.max_ctas = CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        self.arch = runtime.device_arch(device.index)
        self.ids = runtime.cute_dtype(ids_dtype)
        self.index = id_radix.Workspace(device)
        self.record = errors.record(device.index)
        # grad_norm_weight partials, two segment partials per range, the id status
        self.workspace = _Workspace(3 * self.max_ctas + 1, hidden, device)

    @functools.cached_property
    def run(self):
        return runtime.ffi_function(_build(self.hidden, self.accumulate, self.norm_weight, self.arch,
                                           model=self.model))

    @functools.cached_property
    def run_early_fill(self):
        return runtime.ffi_function(_build(self.hidden, self.accumulate, self.norm_weight, self.arch,
                                           early_fill=True, model=self.model))

    @functools.cached_property
    def run_sort_on_chip(self):
        return runtime.ffi_function(_build(self.hidden, self.accumulate, self.norm_weight, self.arch,
                                           ids_dtype=self.ids, model=self.model))

    @functools.cached_property
    def run_range_and_keys(self):
        return runtime.ffi_function(build_range_and_keys(self.ids, self.arch))

    @functools.cached_property
    def run_widen_keys(self):
        return runtime.ffi_function(build_widen_keys(self.arch))

    @functools.cached_property
    def run_radix_sort(self):
        return runtime.ffi_function(id_radix.build(self.ids, self.arch))

    @functools.cached_property
    def run_radix_sort_three_digits(self):
        return runtime.ffi_function(id_radix.build(self.ids, self.arch, digits=3))

    def sort(self, ids, vocab_size):
        """(sorted ids int32, order int64, the radix sort's (marks, ranges, marked)) of ids above
        SORT_ON_CHIP_MAX_TOKENS, with the verdict on the first sorted id (-1: an id outside [0,
        vocab_size)) and bad ids' range in the error record; no host synchronization on any
        path. `marked` is 1 where a fresh table's call went through the radix sort, whose marks
        then let the row kernel fill while it runs."""
        import torch

        tokens = ids.numel()
        index = self.index.get()
        radix = (index.marks, index.ranges, 0)
        if tokens <= id_radix.MAX_TOKENS and vocab_size <= id_radix.MAX_VOCAB:
            # Our radix sort: three kernels in one call (id_radix).
            sorted_ids, order = index.sorted_ids[:tokens], index.order[:tokens]
            two_digits = id_radix.digits_for(vocab_size) == 2
            mark = int(not self.accumulate and tokens <= EARLY_FILL_MAX_TOKENS and two_digits)
            radix_sort = self.run_radix_sort if two_digits else self.run_radix_sort_three_digits
            radix_sort(ids, index.counts, index.ranges, index.keys, index.tokens, sorted_ids, order, self.record,
                       index.marks, vocab_size, mark)
            return sorted_ids, order, (index.marks, index.ranges, mark)
        if vocab_size <= KEYS_MAX_VOCAB:
            # One pass for the ids' ranges and int16 keys (two radix passes of PyTorch's sort
            # instead of int32's four); WidenKeys widens them and rules on the ranges.
            ranges = index.ranges[:RangeAndKeys.CTAS]
            keys = ids.new_empty(tokens, dtype=torch.int16)
            self.run_range_and_keys(ids, keys, ranges)
            sorted_keys, order = torch.sort(keys, stable=True)
            sorted_ids = ids.new_empty(tokens, dtype=torch.int32)
            self.run_widen_keys(sorted_keys, ranges, sorted_ids, self.record, vocab_size, WidenKeys.ctas(tokens))
            return sorted_ids, order, radix
        # Larger vocabularies: PyTorch's operations throughout (a dozen launches, no waiting).
        smallest, largest = torch.aminmax(ids)
        bad = (smallest < 0) | (largest >= vocab_size)
        # Every id -1 when any is bad: the kernels see the verdict on the first sorted id.
        sorted_ids, order = torch.sort(torch.where(bad, -1, ids).to(torch.int32), stable=True)
        found = torch.stack([smallest, largest, torch.full_like(smallest, vocab_size)])
        first = bad & (self.record[0] == 0)  # the first error sticks
        self.record[1:].copy_(torch.where(first, found, self.record[1:]))
        # The code after the range, in a later kernel: the host never reads a code without it.
        self.record[:1].copy_(torch.where(first, errors.EMBEDDING, self.record[:1]))
        return sorted_ids, order, radix


class _Workspace(runtime.StreamWorkspace):
    """Per stream: the workspace (its last row's first element the id status, which only the
    kernels read), and where on-chip sorts leave the sorted ids for the fix-up (the index
    passes' buffers: id_radix.Workspace)."""

    def _new(self):
        import torch

        buffer = super()._new()
        # the sorted ids, then the one-launch build's arrival count (zero before its first use) and
        # a status word per CTA (finish_in_grid)
        words = SORT_ON_CHIP_MAX_TOKENS + 1 + self.shape[0]
        return buffer, torch.zeros(words, dtype=torch.int32, device=self.device)


def _call_key(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate):
    _, _, hidden = grad_output.shape
    return hidden, bool(accumulate), input_ids.dtype, norm_weight.dtype, grad_output.get_device()


def _check_call(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate):
    _check_inputs(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size)


def _new_entry(key, grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate):
    return _Entry(key[0], key[1], input_ids.dtype, norm_weight.dtype, grad_output.device)


_calls = CallCache(_call_key, _check_call, _new_entry)
CHECK_IDS = ("deferred", "now")
# Walking CTAs take at least TOKENS_PER_CTA sorted positions each (SMALL_CALL_TOKENS_PER_CTA
# below SMALL_CALL_TOKENS): fewer, fuller CTAs make the fix-up's grid and the weight partials
# smaller, shorter walks finish sooner. Fresh calls are paced by the table's fill instead.
TOKENS_PER_CTA = 8
SMALL_CALL_TOKENS, SMALL_CALL_TOKENS_PER_CTA = 1024, 4
# Accumulate calls of up to SMALL_CALL_TOKENS spread their positions evenly over one CTA an SM:
# an SM streams a token's rows at a few tens of GB/s, so the busiest SM's share sets the walk's
# length. H200, GPU time a call at 128 / 256 tokens with the sort skipped: 4 positions a CTA 11.1 /
# 11.5 us, 2 a CTA 8.6 / 9.4; at 512 tokens 2 a CTA (two CTAs an SM) lost, 16.1 against 14.6.
# Where some CTAs only fill, a walking CTA takes this share of a filling CTA's rows (_split).
WALKER_FILL_SHARE = 0.8
# A fresh table is filled by FILL_WAVES x (resident CTAs): the block scheduler hands the later
# CTAs' row shares to SMs as earlier CTAs finish, so no SM's slow share sets the call's end
# (H200, fresh mean of the 16 workloads 207.3 us at one wave, 205.9 at four, 208.7 at two).
FILL_WAVES = 4


@functools.lru_cache(maxsize=1024)  # on every call's host path; a pure function of ints
def _split(tokens: int, vocab_size: int, max_ctas: int, accumulate: bool):
    """(walking CTAs, grid, walker_rows) of a call (EmbeddingRmsNormBackward.kernel): an
    accumulating call's grid is its walking CTAs (up to SMALL_CALL_TOKENS tokens one an SM); a fresh
    table is filled by FILL_WAVES x max_ctas CTAs whatever the token count, more where a CTA's
    share of the rows would pass FILL_ROWS. The walking CTAs fill rows [0, walker_rows), the others the rest:
    where some CTAs only fill, a walking CTA takes WALKER_FILL_SHARE of a filling CTA's rows,
    since its walk comes first."""
    if accumulate:
        per_cta = -(-tokens // (max_ctas // CTAS_PER_SM)) if tokens <= SMALL_CALL_TOKENS else TOKENS_PER_CTA
        walkers = min(-(-tokens // per_cta), max_ctas)
        return walkers, walkers, 0
    per_cta = SMALL_CALL_TOKENS_PER_CTA if tokens < SMALL_CALL_TOKENS else TOKENS_PER_CTA
    walkers = min(-(-tokens // per_cta), max_ctas)
    grid = max(FILL_WAVES * max_ctas, -(-vocab_size // FILL_ROWS))
    walker_rows = vocab_size * walkers // grid  # an even cut
    if walkers < grid:
        weighted = int(vocab_size * walkers * WALKER_FILL_SHARE / (walkers * WALKER_FILL_SHARE + grid - walkers))
        if -(-(vocab_size - weighted) // (grid - walkers)) <= FILL_ROWS:
            walker_rows = weighted
    return walkers, grid, walker_rows


def embedding_rmsnorm_backward(grad_output, input_ids, hidden_states, rstd, norm_weight, *, vocab_size=65536,
                               out=None, accumulate=False, check_ids="deferred"):
    """The embedding + RMSNorm backward: -> (grad_embed_weight [vocab_size, H] bf16,
    grad_norm_weight [H]), as semantics.md says; grad_norm_weight is bf16 for a bf16 norm_weight
    (the contract's), fp32 for an fp32 one.

    grad_output bf16 and hidden_states fp32 [b, s, H] (any batch/seq strides that are multiples
    of 4 elements, contiguous last dim); input_ids int64 or int32 [b, s] (the kernels read
    them flat: ids whose [b, s] view is not one flat run are copied first, T ids, one small
    PyTorch copy); rstd fp32 [b, s, 1]; norm_weight bf16 or fp32 [H]; H a multiple of 8 up to
    16384. grad_norm_weight is summed in fp32 and rounded once to norm_weight's dtype.
    - Without `out` the table is allocated; with `out=(grad_embed_weight, grad_norm_weight)`
      the caller's tensors are written, grad_norm_weight in norm_weight's dtype. Either way the
      row kernel writes a fresh table whole, each row once: the touched rows their sums, the
      others zeros (no fill beforehand).
    - `accumulate=True` (with `out`) adds this step's rows into the table, reading and writing
      only the touched rows.
    Repeated ids are summed in fp32 in token order and each touched row is rounded to bf16
    once: bitwise repeatable.

    Ids outside [0, vocab_size) are caught on the device before anything is written; then the
    call writes nothing into outputs passed to it (an accumulated table survives) and fills
    outputs it allocated with NaN.
    - check_ids="deferred" (the default): no host synchronization. The error goes to the
      device's error record, and the next cutebwd call on the device (made once the GPU has
      run this one) raises ValueError with the ids' range; `cutebwd.check_errors()`
      synchronizes and raises it on demand. CUDA-graph capturable; the CUDA context survives.
    - check_ids="now": the call synchronizes its stream and raises before it returns.

    The index pass: up to SORT_ON_CHIP_MAX_TOKENS tokens (vocabularies up to
    SORT_ON_CHIP_MAX_VOCAB) in the row kernel; above, up to id_radix.MAX_TOKENS (vocabularies
    up to 2^24), our radix sort; otherwise PyTorch's stable sort (_Entry.sort).
    """
    import torch

    if accumulate and out is None:
        raise ValueError("accumulate=True adds into an existing table: pass out=(grad_embed_weight, grad_norm_weight)")
    try:
        entry = _calls[_call_key(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate)]
    except KEY_ERRORS:
        entry = _calls.first_call(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate)
    errors.raise_pending(entry.device_index)
    batch, seq, hidden = grad_output.shape
    if check_ids not in CHECK_IDS:
        raise ValueError(f"check_ids: expected one of {CHECK_IDS}, got {check_ids!r}")
    tokens = batch * seq
    own = out is None  # bad ids fill the call's own outputs with NaN, and leave a caller's alone
    if own:
        out = (torch.empty((vocab_size, hidden), dtype=torch.bfloat16, device=entry.device),
               torch.empty(hidden, dtype=norm_weight.dtype, device=entry.device))
    elif not (accumulate and _table_rows(out) == vocab_size):
        # An accumulate call writes nothing before the FFI call, which checks dtypes, shapes,
        # strides, alignment and device itself (the table's row count is ours to check): there
        # the Python checks run only to explain a rejected call.
        out = _check_out(out, hidden_states, norm_weight, vocab_size)
    table, grad_norm_weight = out
    if tokens == 0 or tokens >= 2**31:
        _check_inputs(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size)
        _check_out(out, hidden_states, norm_weight, vocab_size)
        if not accumulate:
            table.zero_()
        grad_norm_weight.zero_()
        return out
    try:
        _launch(entry, tokens, grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, table,
                grad_norm_weight, int(own))
    except Exception:
        # The C-side checks rejected an argument; say which one and why in our own words.
        _check_inputs(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size)
        _check_out(out, hidden_states, norm_weight, vocab_size)
        raise
    if check_ids == "now":
        torch.cuda.current_stream(entry.device).synchronize()
        errors.raise_pending(entry.device_index)
    return out


def _table_rows(out) -> int:
    """The row count of out's table, where out is a tuple of two whose first item has rows; else
    -1 (_check_out then explains, or takes a list as that tuple)."""
    if type(out) is not tuple:
        return -1
    try:
        table, _ = out
        return table.shape[0]
    except (AttributeError, IndexError, TypeError, ValueError):
        return -1


def _launch(entry, tokens: int, grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size: int, table,
            grad_norm_weight, poison: int, model=(None, None, None)):
    """The index pass where the call's size needs one, then the row kernel's FFI call (with the
    fix-up); `model`: the model form's (residual_grad, embed_scale, padding id or -1)."""
    workspace, sorted_on_chip = entry.workspace.get()
    ctas, grid, walker_rows = _split(tokens, vocab_size, entry.max_ctas, entry.accumulate)
    if tokens <= SORT_ON_CHIP_MAX_TOKENS and vocab_size <= SORT_ON_CHIP_MAX_VOCAB:
        if not input_ids.is_contiguous():  # the kernel reads the [b, s] ids flat
            input_ids = input_ids.contiguous()
        entry.run_sort_on_chip(grad_output, hidden_states, rstd, norm_weight, input_ids, sorted_on_chip,
                               entry.record, table, grad_norm_weight, workspace, ctas, grid, walker_rows, poison,
                               *model)
    else:
        sorted_ids, order, (marks, ranges, marked) = entry.sort(input_ids.reshape(tokens), vocab_size)
        try:
            (entry.run_early_fill if marked else entry.run)(
                grad_output, hidden_states, rstd, norm_weight, sorted_ids, order, table, grad_norm_weight,
                workspace, marks, ranges, ctas, grid, walker_rows, poison, marked, *model)
        except Exception:
            marks.zero_()  # the sort marked them and no fix-up will: clean for the next call
            raise


_model_entries: dict = {}  # (hidden, accumulate, ids dtype, norm_weight dtype, device index) -> the model form's _Entry


def embedding_norm_backward(grad_normed, input_ids, embeds, rstd, norm_weight, residual_grad, embed_scale: float,
                            table, grad_norm_weight, *, accumulate: bool, poison: bool, padding_idx=None):
    """A model's embedding lookup and first RMSNorm, backward (kernels/embedding_norm.py's
    embedding_norm): embeds = embed_scale * table rows, the norm reads embeds and the residual
    branch carries them on, so (w = norm_weight, the weight the norm multiplies by: Gemma's 1 + w)

        dx_t = rstd_t * (g_t * w - x_t * rstd_t^2 * sum_j(g_tj w_j x_tj) / H)   (g = grad_normed, x = embeds)
        table[v] = bf16([table[v] +] embed_scale * sum over tokens t with id v of (dx_t + residual_grad_t))
        grad_norm_weight = sum over tokens of g_t * x_t * rstd_t

    in fp32, each table row rounded once, bitwise repeatable, as embedding_rmsnorm_backward.
    grad_normed, embeds, residual_grad bf16 [b, s, H]; input_ids int64 or int32 [b, s]; rstd fp32
    [b, s, 1]; norm_weight and grad_norm_weight [H], both fp32 or both bf16; table bf16 [V, H]. The caller checks
    dtypes and shapes; the C entry point checks them again with strides and alignment. Ids outside
    [0, V) are caught on the device and reported at a later call (check_ids="deferred"): then
    nothing is written, or, with `poison` (outputs the caller made for this call), NaN.
    `padding_idx` (torch.nn.Embedding's): that row gets no gradient, zero in a fresh table and
    left as it was with accumulate."""
    key = (embeds.shape[-1], bool(accumulate), input_ids.dtype, norm_weight.dtype, embeds.get_device())
    entry = _model_entries.get(key)
    if entry is None:
        entry = _model_entries[key] = _Entry(key[0], key[1], input_ids.dtype, norm_weight.dtype, embeds.device,
                                             model=True)
    errors.raise_pending(entry.device_index)
    tokens = input_ids.numel()
    if tokens == 0:
        if not accumulate:
            table.zero_()
        grad_norm_weight.zero_()
        return
    padding = -1 if padding_idx is None else int(padding_idx)  # an id no token has: none
    _launch(entry, tokens, grad_normed, input_ids, embeds, rstd, norm_weight, table.shape[0], table,
            grad_norm_weight, int(poison), (residual_grad, float(embed_scale), padding))


# The benchmark's calls (bf16 norm_weight, a fresh table: ids sorted on chip up to
# SORT_ON_CHIP_MAX_TOKENS tokens, sorted beforehand above), accumulation both ways, and an fp32
# norm_weight (fp32 grad_norm_weight).
_AUDITED = {  # name: (norm_weight dtype, accumulate, other build options)
    "norm_weight bf16,fresh,ids sorted on chip": (BFloat16, False, {"ids_dtype": Int64}),
    "norm_weight bf16,fresh": (BFloat16, False, {}),
    "norm_weight bf16,fresh,fill during the radix sort": (BFloat16, False, {"early_fill": True}),
    "norm_weight bf16,accumulate": (BFloat16, True, {}),
    "norm_weight bf16,accumulate,ids sorted on chip,one launch": (BFloat16, True, {"ids_dtype": Int64}),
    "norm_weight fp32,fresh": (Float32, False, {}),
    "model form,fresh,ids sorted on chip": (Float32, False, {"ids_dtype": Int64, "model": True}),
    "model form,accumulate": (Float32, True, {"model": True}),
    "model form,norm_weight bf16,accumulate,ids sorted on chip,one launch": (BFloat16, True,
                                                                            {"ids_dtype": Int64, "model": True}),
}
AUDIT_BUILDS = {
    f"embedding_rmsnorm_backward[H=4096,{name}]":
        (lambda arch, dump_dir, dtype=dtype, acc=acc, options=options:
         _build(4096, acc, dtype, arch, dump_dir, **options))
    for name, (dtype, acc, options) in _AUDITED.items()
}
# 128-bit loads of the fp32 rows (the partials, an fp32 norm_weight, hidden_states where no ring
# holds them); no spills; no atomics (every sum has a fixed order).
AUDIT_EXPECTS = {arch: {"require": ["LDG.128"], "forbid": ["LOCAL", "ATOM/RED"]} for arch in runtime.ARCHES}
# The one-launch builds' grid barrier counts arrivals with an integer atomic: still no float one.
AUDIT_EXPECTS_BY_BUILD = {
    name: {arch: {"require": ["LDG.128", "ATOM/RED"], "forbid": ["LOCAL", "ATOM/RED.FLOAT"]} for arch in runtime.ARCHES}
    for name in AUDIT_BUILDS if "one launch" in name}
