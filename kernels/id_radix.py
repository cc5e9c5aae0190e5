"""The embedding backward's index pass for large calls, native: a stable LSD radix sort of the
token ids on two 8-bit digits (vocabularies up to 65536 ids), or three for up to 2^24 ids (real
models' vocabularies: 131072-262144), one kernel a digit plus one, in one FFI call. It replaces the range pass,
PyTorch's stable sort (ten operations: a copy, an index fill, four memsets, a histogram, a scan,
two onesweep passes) and the widening: 24 us less a call at 32K tokens on the H200
(docs/design-embedding.md).

The ids are cut into chunks of CHUNK tokens, one CTA each, in every kernel:
1. `counts`: per chunk, the smallest and largest id (for the verdict below) and how many ids
   have each low digit; it also zeroes the chunk's high-digit counts.
2. `low pass`: each CTA ranks its chunk's ids by low digit, stably, and writes (key, token) to
   position = the digit's start over all chunks + the earlier chunks' count of it + the rank.
   As it writes, it counts high digits per destination chunk (integer atomics: counts, the
   same whatever their order).
   With three digits a `middle pass` does the same over the low pass's output by the middle
   digit, counting the high digits.
3. `high pass` over the last pass's output: the sorted ids (int32) and their tokens (int64, the order),
   bitwise what a stable sort gives. The thread that writes position 0 writes -1 there when a
   chunk's range leaves [0, vocab), so every later kernel refuses the call and writes nothing,
   and CTA 0 records the ids' range in the device's error record (errors.py).

With `mark` (a fresh table's call) `counts` also sets a bit per id in `marks` (the rows the call
touches) and each CTA of `counts` and of the high pass counts itself done there, so the row
kernel's CTAs fill untouched rows while the sort runs and stop filling to walk once it has
ended (embedding_row_kernel.py). The fix-up zeroes `marks` for the next call.

Ranking within a chunk: each warp takes 128 consecutive tokens in four rounds of 32 lanes;
match.any finds the lanes of a round with the same digit, a per-warp count per digit in
shared memory carries the rank across rounds, and an exclusive sum over the warps orders
them. Keys are the id's low 16 (two digits) or 24 bits: exact for the vocabularies each serves
once the range check passes, and never out of bounds before it.
"""
from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64

from . import errors, runtime

CHUNK = 1024
THREADS = 256  # one digit a thread where digits are handled one by one
WARPS = THREADS // 32
ROUNDS = CHUNK // THREADS
DIGIT_BITS = 8
DIGITS = 1 << DIGIT_BITS
NO_DIGIT = DIGITS  # a lane past the last token: matches no digit
MAX_CHUNKS = 128  # each CTA reads every chunk's count of its digit
MAX_TOKENS = CHUNK * MAX_CHUNKS
MAX_DIGITS = 3
MAX_VOCAB = 1 << (MAX_DIGITS * DIGIT_BITS)


def digits_for(vocab: int) -> int:
    """Digits the sort of a vocabulary's ids takes: two up to 65536 ids, else three."""
    return 2 if vocab <= 1 << (2 * DIGIT_BITS) else 3


# marks (a fresh table's two-digit calls only): a bit per id of a 65536-id vocabulary, then the
# counts' and the high pass's done-CTA counters
MARK_VOCAB = 1 << (2 * DIGIT_BITS)
MARK_WORDS = MARK_VOCAB // 32
COUNTS_DONE, SORT_DONE = MARK_WORDS, MARK_WORDS + 1


def chunks(tokens: int) -> int:
    return -(-tokens // CHUNK)


@cute.jit
def block_range(smem, smallest, largest, tidx):
    """(smallest, largest) over a CTA of THREADS threads: a tree over shared memory."""
    lows = smem.allocate_tensor(Int64, cute.make_layout((THREADS,)), byte_alignment=16)
    highs = smem.allocate_tensor(Int64, cute.make_layout((THREADS,)), byte_alignment=16)
    lows[tidx] = smallest
    highs[tidx] = largest
    cute.arch.barrier()
    half = THREADS // 2
    while half > 0:
        if tidx < half:
            lows[tidx] = cutlass.min(lows[tidx], lows[tidx + half])
            highs[tidx] = cutlass.max(highs[tidx], highs[tidx + half])
        cute.arch.barrier()
        half = half // 2
    return lows[0], highs[0]


@cute.jit
def _positions(smem, digits, m_counts, count_row, chunk, chunk_count, tidx):
    """Where each of this thread's ROUNDS tokens goes (digits[r] == NO_DIGIT: none). m_counts
    rows count_row + c hold chunk c's count of each digit."""
    warp = tidx // 32
    warp_counts = smem.allocate_tensor(Int32, cute.make_layout((WARPS, DIGITS), stride=(DIGITS, 1)),
                                       byte_alignment=16)
    starts = smem.allocate_tensor(Int32, cute.make_layout((DIGITS,)), byte_alignment=16)
    for w in cutlass.range_constexpr(WARPS):
        warp_counts[w, tidx] = Int32(0)
    # Digit tidx: its count over all chunks and over the earlier ones (independent loads).
    total, before = Int32(0), Int32(0)
    for c in cutlass.range(chunk_count, unroll=16):
        n = m_counts[count_row + c, tidx]
        total += n
        if c < chunk:
            before += n
    starts[tidx] = total
    cute.arch.barrier()
    for step in cutlass.range_constexpr(DIGIT_BITS):  # inclusive sum over the digits
        lower = Int32(0)
        if tidx >= (1 << step):
            lower = starts[tidx - (1 << step)]
        cute.arch.barrier()
        starts[tidx] = starts[tidx] + lower
        cute.arch.barrier()
    start = starts[tidx] - total + before
    cute.arch.barrier()
    starts[tidx] = start
    ranks = cute.make_rmem_tensor((ROUNDS,), Int32)
    for r in cutlass.range_constexpr(ROUNDS):
        digit = digits[r]
        peers = cute.arch.match_sync(0xFFFFFFFF, digit)
        below = Int32(cute.arch.popc(peers & cute.arch.lanemask_lt()))
        seen = Int32(0)
        if digit != NO_DIGIT:
            seen = warp_counts[warp, digit]
        cute.arch.sync_warp()
        if digit != NO_DIGIT and below == Int32(cute.arch.popc(peers)) - 1:  # the round's last peer
            warp_counts[warp, digit] = seen + below + 1
        cute.arch.sync_warp()
        ranks[r] = seen + below
    cute.arch.barrier()
    running = Int32(0)  # digit tidx: the earlier warps' count of it
    for w in cutlass.range_constexpr(WARPS):
        n = warp_counts[w, tidx]
        warp_counts[w, tidx] = running
        running += n
    cute.arch.barrier()
    positions = cute.make_rmem_tensor((ROUNDS,), Int32)
    for r in cutlass.range_constexpr(ROUNDS):
        positions[r] = Int32(-1)
        if digits[r] != NO_DIGIT:
            positions[r] = starts[digits[r]] + warp_counts[warp, digits[r]] + ranks[r]
    return positions


def _token(chunk, tidx, r):
    """The r-th token of this thread: warps take 128 consecutive tokens, lanes consecutive ones."""
    return chunk * CHUNK + (tidx // 32) * (32 * ROUNDS) + r * 32 + tidx % 32


@cute.jit
def _chunk_keys(m_source, tokens, chunk, tidx, level: cutlass.Constexpr, key_mask: cutlass.Constexpr):
    """This thread's ROUNDS keys and their digit `level` (NO_DIGIT past the last token): keys =
    id & key_mask from the ids (level 0), else the previous pass's keys."""
    keys = cute.make_rmem_tensor((ROUNDS,), Int32)
    digits = cute.make_rmem_tensor((ROUNDS,), Int32)
    for r in cutlass.range_constexpr(ROUNDS):
        token = _token(chunk, tidx, r)
        keys[r], digits[r] = Int32(0), Int32(NO_DIGIT)
        if token < tokens:
            if cutlass.const_expr(level == 0):
                keys[r] = Int32(m_source[token]) & key_mask
            else:
                keys[r] = m_source[token]
            digits[r] = (keys[r] >> (level * DIGIT_BITS)) & (DIGITS - 1)
    return keys, digits


@cute.jit
def record_bad_ids(m_record: cute.Tensor, smallest, largest, vocab):
    """Writes the ids' range and the vocabulary into the device's error record (errors.py),
    the op code last, so the host never reads a code without its range."""
    m_record[1] = Int64(smallest)
    m_record[2] = Int64(largest)
    m_record[3] = Int64(vocab)
    cute.arch.fence_acq_rel_sys()
    m_record[0] = Int64(errors.EMBEDDING)


@cute.jit
def report_bad_ids(m_record: cute.Tensor, m_ranges: cute.Tensor, count, vocab):
    """Records the range over `count` [smallest, largest] ranges, unless the record holds an
    error already (the first one sticks). One thread, on the error path only."""
    if m_record[0] == 0:
        smallest, largest = m_ranges[0, 0], m_ranges[0, 1]
        for c in cutlass.range(1, count):
            smallest = cutlass.min(smallest, m_ranges[c, 0])
            largest = cutlass.max(largest, m_ranges[c, 1])
        record_bad_ids(m_record, smallest, largest, vocab)


class IdRadixSort:
    """ids [T] (int64 or int32) -> sorted ids [T] int32 and order [T] int64, with per-chunk
    ranges [MAX_CHUNKS, 2] int64 (the verdict's) and the device's error record [4] int64 for
    bad ids, on `digits` (2 or 3) digits. Workspace: counts [MAX_DIGITS MAX_CHUNKS, DIGITS]
    int32 (digit d's counts per chunk of the pass that reads it in rows d MAX_CHUNKS on), keys
    and tokens [(MAX_DIGITS - 1) MAX_TOKENS] int32 between the passes (pass d writes slice d).
    `marks` [MARK_WORDS + 2] int32, zero on entry, written where `mark` is 1 (two digits only;
    the module docstring)."""

    def __init__(self, digits: int = 2):
        self.digits = digits
        self.key_mask = (1 << (digits * DIGIT_BITS)) - 1

    @cute.jit
    def __call__(self, ids: cute.Tensor, counts: cute.Tensor, ranges: cute.Tensor, keys: cute.Tensor,
                 tokens: cute.Tensor, sorted_ids: cute.Tensor, order: cute.Tensor, record: cute.Tensor,
                 marks: cute.Tensor, vocab: Int32, mark: Int32, stream: cuda.CUstream):
        # The passes are programmatic dependents: launched while the kernel before runs, they
        # wait on griddepcontrol before reading what it wrote (one launch latency saved each).
        grid = [cute.ceil_div(cute.size(ids), CHUNK), 1, 1]
        low_keys, low_tokens = _slice(keys, 0), _slice(tokens, 0)
        self.counts(ids, counts, ranges, marks, mark).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)
        self.low_pass(ids, counts, low_keys, low_tokens).launch(grid=grid, block=[THREADS, 1, 1], stream=stream,
                                                                use_pdl=True)
        last_keys, last_tokens = low_keys, low_tokens
        if cutlass.const_expr(self.digits == 3):
            last_keys, last_tokens = _slice(keys, 1), _slice(tokens, 1)
            self.middle_pass(low_keys, low_tokens, cute.size(ids), counts, last_keys, last_tokens).launch(
                grid=grid, block=[THREADS, 1, 1], stream=stream, use_pdl=True)
        self.high_pass(last_keys, last_tokens, counts, ranges, sorted_ids, order, record, marks, vocab, mark).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def counts(self, m_ids: cute.Tensor, m_counts: cute.Tensor, m_ranges: cute.Tensor, m_marks: cute.Tensor,
               mark: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()  # the low pass may launch; it waits for this grid
        smem = cutlass.memory.SmemAllocator()
        histogram = smem.allocate_tensor(Int32, cute.make_layout((DIGITS,)), byte_alignment=16)
        histogram[tidx] = Int32(0)
        for level in cutlass.range_constexpr(1, self.digits):  # the later passes' counts, made by the one before
            m_counts[level * MAX_CHUNKS + chunk, tidx] = Int32(0)
        cute.arch.barrier()
        smallest, largest = Int64(2**63 - 1), Int64(-(2**63))
        for r in cutlass.range_constexpr(ROUNDS):
            i = chunk * CHUNK + r * THREADS + tidx
            if i < cute.size(m_ids):
                token_id = Int64(m_ids[i])
                smallest = cutlass.min(smallest, token_id)
                largest = cutlass.max(largest, token_id)
                cute.arch.atomic_add(histogram.iterator + (Int32(token_id) & (DIGITS - 1)), Int32(1))
                if mark == 1:
                    key = Int32(token_id) & (MARK_VOCAB - 1)  # in bounds before the range check
                    cute.arch.atomic_or(m_marks.iterator + (key >> 5), Int32(1) << (key & 31))
        smallest, largest = block_range(smem, smallest, largest, tidx)  # its barriers order the histogram
        m_counts[chunk, tidx] = histogram[tidx]
        if tidx == 0:
            m_ranges[chunk, 0] = smallest
            m_ranges[chunk, 1] = largest
        if mark == 1:
            _count_done(m_marks, COUNTS_DONE, tidx)  # the marks and the range: the row kernel's fill may start

    @cute.kernel
    def low_pass(self, m_ids: cute.Tensor, m_counts: cute.Tensor, m_keys: cute.Tensor, m_tokens: cute.Tensor):
        self.scatter_pass(m_ids, None, cute.size(m_ids), m_counts, m_keys, m_tokens, 0)

    @cute.kernel
    def middle_pass(self, m_source: cute.Tensor, m_source_tokens: cute.Tensor, tokens: Int32,
                    m_counts: cute.Tensor, m_keys: cute.Tensor, m_tokens: cute.Tensor):
        self.scatter_pass(m_source, m_source_tokens, tokens, m_counts, m_keys, m_tokens, 1)

    @cute.jit
    def scatter_pass(self, m_source, m_source_tokens, tokens, m_counts, m_keys, m_tokens, level: cutlass.Constexpr):
        """Pass `level` of a sort with a later one: keys ranked by digit `level` and written with
        their tokens to their positions; the next digit counted per destination chunk."""
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        chunk_count, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(level > 0):
            cute.arch.griddepcontrol_wait()  # the previous pass's keys
        keys, digits = _chunk_keys(m_source, tokens, chunk, tidx, level, self.key_mask)  # level 0: an input
        if cutlass.const_expr(level == 0):
            cute.arch.griddepcontrol_wait()  # the counts are complete past this point
        positions = _positions(smem, digits, m_counts, level * MAX_CHUNKS, chunk, chunk_count, tidx)
        for r in cutlass.range_constexpr(ROUNDS):
            if digits[r] != NO_DIGIT:
                p = positions[r]
                m_keys[p] = keys[r]
                token = _token(chunk, tidx, r)
                if cutlass.const_expr(level > 0):
                    token = m_source_tokens[token]
                m_tokens[p] = token
                next_digit = (keys[r] >> ((level + 1) * DIGIT_BITS)) & (DIGITS - 1)
                count = m_counts.iterator + (((level + 1) * MAX_CHUNKS + p // CHUNK) * DIGITS + next_digit)
                cute.arch.atomic_add(count, Int32(1))

    @cute.kernel
    def high_pass(self, m_keys: cute.Tensor, m_tokens: cute.Tensor, m_counts: cute.Tensor, m_ranges: cute.Tensor,
                  m_sorted: cute.Tensor, m_order: cute.Tensor, m_record: cute.Tensor, m_marks: cute.Tensor,
                  vocab: Int32, mark: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        chunk_count, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        cute.arch.griddepcontrol_launch_dependents()  # the row kernel
        cute.arch.griddepcontrol_wait()  # the previous pass's keys and counts are complete past this point
        keys, digits = _chunk_keys(m_keys, cute.size(m_sorted), chunk, tidx, self.digits - 1, self.key_mask)
        # The ranges' verdict, one chunk a thread (a loop in the one thread that writes position
        # 0 cost a dependent load per chunk on the sort's critical path).
        bad = smem.allocate_tensor(Int32, cute.make_layout((1,)), byte_alignment=16)
        if tidx == 0:
            bad[0] = Int32(0)
        cute.arch.barrier()
        if tidx < chunk_count:
            if m_ranges[tidx, 0] < 0 or m_ranges[tidx, 1] >= Int64(vocab):
                bad[0] = Int32(1)
        # _positions's barriers order `bad` for the reads below.
        positions = _positions(smem, digits, m_counts, (self.digits - 1) * MAX_CHUNKS, chunk, chunk_count, tidx)
        if chunk == 0 and tidx == 0 and bad[0] == 1:
            report_bad_ids(m_record, m_ranges, chunk_count, vocab)
        for r in cutlass.range_constexpr(ROUNDS):
            if digits[r] != NO_DIGIT:
                p = positions[r]
                sorted_id = keys[r]
                if p == 0 and bad[0] == 1:  # the verdict rides on the first sorted id (module docstring)
                    sorted_id = Int32(-1)
                m_sorted[p] = sorted_id
                m_order[p] = Int64(m_tokens[_token(chunk, tidx, r)])
        if mark == 1:
            _count_done(m_marks, SORT_DONE, tidx)  # the row kernel's walking CTAs stop filling


def _slice(buffer: cute.Tensor, level: int) -> cute.Tensor:
    """Pass `level`'s MAX_TOKENS slice of a between-passes buffer."""
    return cute.make_tensor(buffer.iterator + level * MAX_TOKENS, cute.make_layout(MAX_TOKENS))


@cute.jit
def _count_done(m_marks: cute.Tensor, counter: cutlass.Constexpr, tidx):
    """This CTA's writes are done: thread 0 adds one to m_marks[counter], after them (release)."""
    cute.arch.barrier()
    if tidx == 0:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.atomic_add(m_marks.iterator + counter, Int32(1), sem="release", scope="gpu")


def build(ids_dtype, arch: str, dump_dir=None, digits: int = 2):
    """IdRadixSort on `digits` digits for int64 or int32 ids (Int64 / Int32), called with torch
    tensors."""
    tokens = cute.sym_int32()
    between = ((MAX_DIGITS - 1) * MAX_TOKENS,)
    return runtime.compile_kernel(
        ("id radix sort", str(ids_dtype), digits), IdRadixSort(digits),
        runtime.fake_tensor(ids_dtype, (tokens,), (1,), ids_dtype.width // 8),
        runtime.fake_tensor(Int32, (MAX_DIGITS * MAX_CHUNKS, DIGITS), (DIGITS, 1), 16),
        runtime.fake_tensor(Int64, (MAX_CHUNKS, 2), (2, 1), 16),
        runtime.fake_tensor(Int32, between, (1,), 16), runtime.fake_tensor(Int32, between, (1,), 16),
        runtime.fake_tensor(Int32, (tokens,), (1,), 4), runtime.fake_tensor(Int64, (tokens,), (1,), 8),
        runtime.fake_tensor(Int64, (errors.WORDS,), (1,), 8), runtime.fake_tensor(Int32, (MARK_WORDS + 2,), (1,), 16),
        Int32(1), Int32(0), runtime.env_stream(), arch=arch,
        dump_dir=dump_dir, tvm_ffi=True)


@dataclasses.dataclass
class IndexBuffers:
    """One stream's buffers for the embedding backward's index passes."""
    counts: object  # [MAX_DIGITS MAX_CHUNKS, DIGITS] int32
    ranges: object  # [MAX_CHUNKS, 2] int64: per chunk (radix) or per CTA (RangeAndKeys)
    keys: object  # [(MAX_DIGITS - 1) MAX_TOKENS] int32, between the passes
    tokens: object  # [(MAX_DIGITS - 1) MAX_TOKENS] int32, between the passes
    sorted_ids: object  # [MAX_TOKENS] int32 (the row kernel reads a view)
    order: object  # [MAX_TOKENS] int64 (the row kernel reads a view)
    marks: object  # [MARK_WORDS + 2] int32, zero between calls (IdRadixSort)


class Workspace(runtime.PerStream):
    """IndexBuffers per stream."""

    def _new(self):
        def ints(*shape, dtype=torch.int32):
            return torch.empty(shape, dtype=dtype, device=self.device)

        between = (MAX_DIGITS - 1) * MAX_TOKENS
        return IndexBuffers(counts=ints(MAX_DIGITS * MAX_CHUNKS, DIGITS), ranges=ints(MAX_CHUNKS, 2, dtype=torch.int64),
                            keys=ints(between), tokens=ints(between), sorted_ids=ints(MAX_TOKENS),
                            order=ints(MAX_TOKENS, dtype=torch.int64),
                            marks=torch.zeros(MARK_WORDS + 2, dtype=torch.int32, device=self.device))


AUDIT_BUILDS = {"embedding_rmsnorm_backward ids radix sort": lambda arch, dump_dir: build(Int64, arch, dump_dir),
                "embedding_rmsnorm_backward ids radix sort, three digits":
                    lambda arch, dump_dir: build(Int64, arch, dump_dir, digits=3)}
# 8-byte id loads, 8-byte order stores, the warp match; integer atomics for the digit counts only.
AUDIT_EXPECTS = {arch: {"require": ["LDG.64", "STG.64"], "forbid": ["LOCAL"]} for arch in runtime.ARCHES}
