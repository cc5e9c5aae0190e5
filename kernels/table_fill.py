"""The embedding backward's fresh table, written whole by the row kernel's CTAs (see
embedding_row_kernel.py): each CTA's share of the rows, which of them an id touches (a bit a row
in shared memory), and the fill of the others with zeros (or NaN where bad ids meet the call's
own table). docs/design-embedding.md has the measurements behind each choice.

Three ways to know a CTA's touched rows:
- ids sorted on chip (at most id_sort.MAX_TOKENS): integer atomics from the raw ids;
- ids sorted beforehand: the sorted positions of the share's rows, found by searches;
- after our radix sort with `mark` on (fill_early): the sort's map of the ids, a bit an id, so
  the fill starts while the sort still runs.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int8, Int32, Int64, Uint32

from . import id_radix
from .rows import VECTOR, vector, wide_copy
from .segment_fixup import range_start

# A fresh table's rows are cut evenly over the grid; each CTA marks the rows its share of the
# sorted ids touches in shared memory (a byte a row), so a CTA takes at most FILL_ROWS rows.
FILL_ROWS = 4096
# Marking a CTA's rows scans their sorted positions, in at most MARK_SCAN_ROUNDS loads a
# thread; more positions (an id repeated over many tokens) take a search per row instead.
MARK_SCAN_ROUNDS = 4
# After the radix sort, a walking CTA's early fill checks every STOP_CHECK_ROWS rows whether the
# sort has ended (a load from L2 a thread).
STOP_CHECK_ROWS = 4


class TableFill:
    """The fill's device code for a row kernel of `threads` threads, each holding
    `vectors_per_thread` vectors of a `hidden`-wide row."""

    def __init__(self, hidden: int, threads: int, vectors_per_thread: int):
        self.hidden, self.threads, self.vectors_per_thread = hidden, threads, vectors_per_thread

    @cute.jit
    def fill_share(self, m_table, in_range, poison, bidx, ctas, walker_rows):
        """-> (first, rows, value): this CTA's share of a fresh table, rows first + [0, rows)
        (the walking CTAs cut rows [0, walker_rows) evenly, the others the rest), and what its
        untouched rows get: zeros, or NaN for bad ids in the call's own table (a caller's gets
        nothing: rows = 0)."""
        grid, _, _ = cute.arch.grid_dim()
        first = range_start(bidx, walker_rows, ctas)
        rows = range_start(bidx + 1, walker_rows, ctas) - first
        if bidx >= ctas:
            first = walker_rows + range_start(bidx - ctas, m_table.shape[0] - walker_rows, grid - ctas)
            rows = walker_rows + range_start(bidx + 1 - ctas, m_table.shape[0] - walker_rows, grid - ctas) - first
        value = Float32(0.0)
        if in_range == 0:
            value = Float32(float("nan"))
            if poison == 0:
                rows = Int32(0)
        return first, rows, value

    @cute.jit
    def mark_rows(self, touched, marks, bounds, m_sorted, m_ids, in_range, first, rows, tidx):
        """touched: a bit per row of first + [0, rows), set where an id touches it (none with
        bad ids)."""
        if cutlass.const_expr(m_ids is not None):
            # Ids sorted on chip (at most SORT_ON_CHIP_MAX_TOKENS): a bit per row set from the
            # raw ids by integer atomics (repeated ids set it again), so a filling CTA needs no
            # sort.
            for w in cutlass.range(tidx, (rows + 31) // 32, self.threads):
                touched[w] = Uint32(0)
            cute.arch.barrier()
            if in_range == 1:
                for i in cutlass.range(tidx, cute.size(m_ids), self.threads):
                    r = Int32(m_ids[i]) - first
                    if r >= 0 and r < rows:
                        cute.arch.atomic_or(touched.iterator + r // 32, Uint32(1) << Uint32(r % 32))
        else:
            self.mark_touched(marks, bounds, m_sorted, in_range, first, rows, tidx)
            # The marks as bits, a word per 32 rows: the row loop reads shared memory once a word.
            for w in cutlass.range(tidx, (rows + 31) // 32, self.threads):
                bits = Uint32(0)
                for b in cutlass.range_constexpr(32):
                    if marks[32 * w + b] != 0:
                        bits = bits | Uint32(1 << b)
                touched[w] = bits
        cute.arch.barrier()

    @cute.jit
    def fill_early(self, touched, resume, m_table, m_marks, m_ranges, tokens, poison, bidx, ctas, walker_rows,
                   tidx):
        """After the radix sort's counts pass (id_radix, `mark` on), before its other passes
        end: this CTA's share of the untouched rows from the sort's marks and its verdict from
        the chunks' ranges, then its fill, which a walking CTA's threads leave, each at its own
        row (kept in `resume`), once the sort has ended (checked every STOP_CHECK_ROWS rows)."""
        chunks = (tokens + id_radix.CHUNK - 1) // id_radix.CHUNK
        if tidx == 0:
            resume[self.threads] = Int32(0)  # the verdict: 1 where a chunk's range is bad
            done = Int32(0)
            while done < chunks:
                done = cute.arch.load(m_marks.iterator + id_radix.COUNTS_DONE, Int32, sem="acquire", scope="gpu")
        cute.arch.barrier()
        for c in cutlass.range(tidx, chunks, self.threads):
            smallest = _load_relaxed(m_ranges, 2 * c, Int64)
            largest = _load_relaxed(m_ranges, 2 * c + 1, Int64)
            if smallest < 0 or largest >= Int64(m_table.shape[0]):
                resume[self.threads] = Int32(1)
        cute.arch.barrier()
        in_range = 1 - resume[self.threads]
        first, rows, value = self.fill_share(m_table, in_range, poison, bidx, ctas, walker_rows)
        shift = Uint32(first % 32)
        for w in cutlass.range(tidx, (rows + 31) // 32, self.threads):
            bits = Uint32(0)
            if in_range == 1:  # bad ids: every row gets the value
                word = first // 32 + w
                bits = Uint32(_load_relaxed(m_marks, word)) >> shift
                if shift > Uint32(0):
                    bits = bits | (Uint32(_load_relaxed(m_marks, word + 1)) << (Uint32(32) - shift))
            touched[w] = bits
        cute.arch.barrier()
        values, atom = self.fill_vector(value), wide_copy(BFloat16)
        threads, vectors = self.threads, self.hidden // VECTOR
        r = Int32(0)
        bits = touched[0]
        go = Int32(0)
        if rows > 0:
            go = Int32(1)
        while go == 1:
            if r % 32 == 0:
                bits = touched[r // 32]
            if (bits >> Uint32(r % 32)) & Uint32(1) == Uint32(0):
                _fill_row(atom, values, m_table[first + r, None], tidx, threads, vectors, self.vectors_per_thread)
            r = r + 1
            if r == rows:
                go = Int32(0)
            if bidx < ctas and r % STOP_CHECK_ROWS == 0:
                if _load_relaxed(m_marks, id_radix.SORT_DONE) >= chunks:
                    go = Int32(0)
        resume[tidx] = r

    def fill_vector(self, value):
        """One bf16 vector of `value` (not a row's worth of registers)."""
        wide = cute.make_rmem_tensor((VECTOR,), Float32)
        wide.fill(value)
        values = cute.make_rmem_tensor((VECTOR,), BFloat16)
        values.store(wide.load().to(BFloat16))
        return values

    @cute.jit
    def fill(self, m_table, touched, first, rows, value, tidx, start):
        """Every thread: `value` into its vectors of the rows first + [start, rows) left untouched."""
        values, atom = self.fill_vector(value), wide_copy(BFloat16)
        threads, vectors = self.threads, self.hidden // VECTOR
        bits = touched[0]
        if cutlass.const_expr(not isinstance(start, int)):
            bits = touched[cutlass.min(start, FILL_ROWS - 1) // 32]
        for r in cutlass.range(start, rows):
            if r % 32 == 0:
                bits = touched[r // 32]
            if (bits >> Uint32(r % 32)) & Uint32(1) == Uint32(0):
                _fill_row(atom, values, m_table[first + r, None], tidx, threads, vectors, self.vectors_per_thread)

    @cute.jit
    def mark_touched(self, marks, bounds, m_sorted, in_range, first, rows, tidx):
        """marks[r] = 1 where row first + r (r < rows) is a sorted id, else 0 (all 0 with bad
        ids). The sorted positions of the rows (_sorted_span), then one mark per id; where those
        are many (one id on many tokens), a search per row instead."""
        for r in cutlass.range(tidx, (rows + 31) // 32 * 32, self.threads):  # whole words
            marks[r] = Int8(0)
        if in_range == 1:
            start, end = _sorted_span(m_sorted, first, first + rows, bounds, tidx, self.threads)
            if end - start <= MARK_SCAN_ROUNDS * self.threads:
                for i in cutlass.range(start + tidx, end, self.threads):
                    vid = m_sorted[i]
                    run_start = Int32(1)  # one writer a mark: the id's first position
                    if i > start:
                        if m_sorted[i - 1] == vid:
                            run_start = Int32(0)
                    if run_start == 1:
                        marks[vid - first] = Int8(1)
            else:
                for r in cutlass.range(tidx, rows, self.threads):
                    i = _lower_bound(m_sorted, start, end, first + r)
                    if i < end:
                        if m_sorted[i] == first + r:
                            marks[r] = Int8(1)
        cute.arch.barrier()


@cute.jit
def _fill_row(atom, values, row, tidx, threads: cutlass.Constexpr, vectors: cutlass.Constexpr,
              vectors_per_thread: cutlass.Constexpr):
    """This thread's vectors of a table row <- `values` (one bf16 vector)."""
    for k in cutlass.range_constexpr(vectors_per_thread):
        if tidx + k * threads < vectors:
            cute.copy(atom, values, vector(row, tidx + k * threads))


@cute.jit
def _load_relaxed(m_words, i, dtype: cutlass.Constexpr = Int32):
    """Element i of a contiguous tensor as the GPU holds it now (not a stale L1 line): written by
    another grid that is still running."""
    return cute.arch.load(m_words.iterator + i, dtype, sem="relaxed", scope="gpu")


@cute.jit
def _sorted_span(m_sorted, first, last, bounds, tidx, threads: cutlass.Constexpr):
    """(start, end): the sorted positions whose ids lie in [first, last). Two lower-bound
    searches run together, each round narrowing `threads`-fold (two rounds up to 65536 tokens
    at 256 threads): a CTA waits a few rounds of parallel loads, not log2(T) dependent ones.
    `bounds`: four shared Int32 (each search's [low, high])."""
    if tidx == 0:
        bounds[0], bounds[1] = Int32(0), Int32(cute.size(m_sorted))
        bounds[2], bounds[3] = Int32(0), Int32(cute.size(m_sorted))
    cute.arch.barrier()
    low_a, high_a, low_b, high_b = bounds[0], bounds[1], bounds[2], bounds[3]
    while (high_a - low_a) + (high_b - low_b) > 0:
        cute.arch.barrier()  # every thread has read the bounds before they move
        _narrow(m_sorted, first, low_a, high_a, bounds, 0, tidx, threads)
        _narrow(m_sorted, last, low_b, high_b, bounds, 2, tidx, threads)
        cute.arch.barrier()
        low_a, high_a, low_b, high_b = bounds[0], bounds[1], bounds[2], bounds[3]
    return low_a, low_b


@cute.jit
def _lower_bound(m_sorted, low, high, value) -> Int32:
    """The first position in [low, high) whose sorted id is >= value (high if none)."""
    while low < high:
        middle = (low + high) // 2
        if m_sorted[middle] < value:
            low = middle + 1
        else:
            high = middle
    return low


@cute.jit
def _narrow(m_sorted, value, low, high, bounds, at: cutlass.Constexpr, tidx, threads: cutlass.Constexpr):
    """One round of a k-ary lower bound (the first position whose id is >= value), known to lie
    in [low, high]: thread t looks at i = low + t * step. The one thread whose id is below
    `value` while its next look (i + step, or high) is not narrows the bounds to (i, i + step];
    where no id is below, thread 0 settles on `low`."""
    if high > low:
        step = (high - low + threads - 1) // threads
        i = low + tidx * step
        if i < high:
            if m_sorted[i] < value:
                j = i + step
                next_below = Int32(0)
                if j < high:
                    if m_sorted[j] < value:
                        next_below = Int32(1)
                if next_below == 0:
                    bounds[at] = i + 1
                    bounds[at + 1] = cutlass.min(j, high)
            else:
                if tidx == 0:
                    bounds[at + 1] = low
