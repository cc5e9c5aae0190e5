"""The embedding backward's index pass: the token ids sorted in one CTA's shared memory (small
calls), and for large calls the ids' range and narrowed sort keys in one pass (PyTorch sorts the
keys).

On chip (`sort_ids`):

key = id << TOKEN_BITS | token is unique per token, so sorting the keys ascending groups the
tokens by id, each group in token order: what a stable sort of the ids gives, fixed by the
ids alone (bitwise repeatable sums downstream). A bitonic network over the next power of two
(at least CHUNK; pads sort last). Steps whose pairs lie within a CHUNK of 64 keys run in one
warp's registers (two keys a lane, butterfly shuffles, no barrier); only the wider steps go
through shared memory with a barrier each: 10 barriers at 512 tokens where one a step took 45.
Every CTA sorts for itself, so the index pass costs no launch and no host work.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int16, Int32, Int64

from . import errors, runtime
from .id_radix import THREADS as RADIX_THREADS, block_range, record_bad_ids, report_bad_ids

TOKEN_BITS = 10
MAX_TOKENS = 1 << TOKEN_BITS
PAD = 2**31 - 1  # sorts after every real key
WARP = 32
CHUNK = 2 * WARP  # keys a warp sorts in its registers, two a lane
# Real keys stay below PAD, and PAD's id (PAD >> TOKEN_BITS) lies outside the vocabulary.
MAX_VOCAB = (PAD >> TOKEN_BITS) - 1


@cute.jit
def sort_ids(smem, m_ids: cute.Tensor, vocab, m_publish: cute.Tensor, publish, tidx, threads: cutlass.Constexpr,
             sort=1):
    """-> (in_range, sorted ids, order): the last two shared-memory Int32 tensors of the call's
    token count. in_range is 0 when an id lies outside [0, vocab) (the views are then
    meaningless, but their last id lies outside the vocabulary too). Where `publish` is
    nonzero the sorted ids also go to global m_publish, for a later kernel. Where `sort` is 0
    the ids are only checked (a CTA that needs no order; the views are meaningless).

    Its first global write (the publish) waits on griddepcontrol: the kernel before may still
    read m_publish. Before it, only inputs are read."""
    tokens = cute.size(m_ids)
    keys = smem.allocate_tensor(Int32, cute.make_layout((MAX_TOKENS,)), byte_alignment=16)
    order = smem.allocate_tensor(Int32, cute.make_layout((MAX_TOKENS,)), byte_alignment=16)
    bad_ids = smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=16)
    n = Int32(CHUNK)
    while n < tokens:
        n = n * 2
    if tidx == 0:
        bad_ids[0] = Int32(0)
    cute.arch.barrier()
    for i in cutlass.range(tidx, n, threads):
        key = Int32(PAD)
        if i < tokens:
            token_id = m_ids[i]
            if token_id < 0 or token_id >= vocab:
                bad_ids[0] = Int32(1)  # every writer writes 1: no order needed
            else:
                key = (Int32(token_id) << TOKEN_BITS) | i
        keys[i] = key
    cute.arch.barrier()
    # Bitonic merge steps (k, j): keys i and i + j compared, ascending where bit k of i is clear.
    # Steps with j < CHUNK stay within a chunk: a warp's registers do them, a barrier after.
    _sort_chunks(keys, n * sort, 2, CHUNK, tidx, threads)
    cute.arch.barrier()
    k = Int32(2 * CHUNK)
    while k <= n * sort:
        j = k // 2
        while j >= CHUNK:
            # pair t: i = (t / j) 2j + t % j
            for t in cutlass.range(tidx, n // 2, threads):
                i = 2 * t - (t & (j - 1))
                a, b = keys[i], keys[i + j]
                swap = Int32(0)
                if (i & k) == 0:
                    if a > b:
                        swap = Int32(1)
                else:
                    if a < b:
                        swap = Int32(1)
                if swap == 1:
                    keys[i] = b
                    keys[i + j] = a
            cute.arch.barrier()
            j = j // 2
        _sort_chunks(keys, n, k, k, tidx, threads)
        cute.arch.barrier()
        k = k * 2
    cute.arch.griddepcontrol_wait()
    for i in cutlass.range(tidx, tokens * sort, threads):
        key = keys[i]
        order[i] = key & (MAX_TOKENS - 1)
        keys[i] = key >> TOKEN_BITS
        if publish != 0:
            m_publish[i] = key >> TOKEN_BITS
    cute.arch.barrier()
    in_range = 1 - bad_ids[0]
    return (in_range, cute.make_tensor(keys.iterator, cute.make_layout(tokens)),
            cute.make_tensor(order.iterator, cute.make_layout(tokens)))


@cute.jit
def _sort_chunks(keys, n, k_first, k_last, tidx, threads: cutlass.Constexpr):
    """The bitonic steps (k, j) with k_first <= k <= k_last (powers of two) and j < CHUNK, on each
    CHUNK of keys[:n] in the registers of one warp: lane l holds keys l and l + WARP of its
    chunk, so j = WARP pairs a lane's own two keys and smaller j pair lanes l and l ^ j (a
    butterfly shuffle). Each warp owns its chunks: no barrier inside."""
    lane = tidx % WARP
    for c in cutlass.range(tidx // WARP, n // CHUNK, threads // WARP):
        first = c * CHUNK + lane
        low, high = keys[first], keys[first + WARP]
        k = k_first
        while k <= k_last:
            j = cutlass.min(k // 2, WARP)
            if j == WARP:
                a, b = low, high
                low, high = cutlass.min(a, b), cutlass.max(a, b)
                if (first & k) != 0:
                    low, high = high, low
                j = j // 2
            while j > 0:
                # the lane with bit j clear holds the pair's lower index: it keeps the smaller key
                # where the pair ascends
                lower = Int32((lane & j) == 0)
                low = _exchange(low, cute.arch.shuffle_sync_bfly(low, j), Int32((first & k) == 0) == lower)
                high = _exchange(high, cute.arch.shuffle_sync_bfly(high, j), Int32(((first + WARP) & k) == 0) == lower)
                j = j // 2
            k = k * 2
        keys[first], keys[first + WARP] = low, high


@cute.jit
def _exchange(mine, theirs, keep_smaller):
    result = cutlass.max(mine, theirs)
    if keep_smaller:
        result = cutlass.min(mine, theirs)
    return result


@cute.jit
def report_bad_raw_ids(m_record: cute.Tensor, m_ids: cute.Tensor, vocab):
    """report_bad_ids for raw ids (the on-chip path has no ranges): one thread reads them all,
    on the error path only."""
    if m_record[0] == 0:
        smallest, largest = Int64(m_ids[0]), Int64(m_ids[0])
        for i in cutlass.range(1, cute.size(m_ids)):
            smallest = cutlass.min(smallest, Int64(m_ids[i]))
            largest = cutlass.max(largest, Int64(m_ids[i]))
        record_bad_ids(m_record, smallest, largest, vocab)


# Int16 keys: id - KEY_SHIFT, exact for vocabularies of up to 2^16 ids.
KEY_SHIFT = 2**15
KEYS_MAX_VOCAB = 2**16


class RangeAndKeys:
    """keys[i] = int16(ids[i] - KEY_SHIFT) and, per CTA, the smallest and largest id it read
    (ranges[c] = [smallest, largest], int64), in one pass over the ids: what aminmax, a
    subtraction and a cast did in three launches (~10 us of GPU time at 32K tokens, most of it
    aminmax). WidenKeys adds up the CTAS ranges; keys are meaningful once those are in range.
    """

    CTAS = 16
    THREADS = RADIX_THREADS  # block_range's

    @cute.jit
    def __call__(self, ids: cute.Tensor, keys: cute.Tensor, ranges: cute.Tensor, stream: cuda.CUstream):
        self.kernel(ids, keys, ranges).launch(grid=[self.CTAS, 1, 1], block=[self.THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, m_ids: cute.Tensor, m_keys: cute.Tensor, m_ranges: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tokens = cute.size(m_ids)
        smem = cutlass.memory.SmemAllocator()
        smallest, largest = Int64(2**63 - 1), Int64(-(2**63))
        # CTA c reads every CTAS-th block of THREADS ids: coalesced, and every CTA busy.
        for i in cutlass.range(bidx * self.THREADS + tidx, tokens, self.CTAS * self.THREADS, unroll=4):
            token_id = Int64(m_ids[i])
            smallest = cutlass.min(smallest, token_id)
            largest = cutlass.max(largest, token_id)
            m_keys[i] = Int16(Int32(token_id) - KEY_SHIFT)
        smallest, largest = block_range(smem, smallest, largest, tidx)
        if tidx == 0:
            m_ranges[bidx, 0] = smallest
            m_ranges[bidx, 1] = largest


class WidenKeys:
    """sorted_ids[i] = int32(sorted_keys[i]) + KEY_SHIFT once PyTorch has sorted RangeAndKeys's
    keys, and the ranges' verdict for the kernels that read the sorted ids: with any id outside
    [0, vocab), sorted_ids[0] = -1, which their check of the sorted ends refuses, so they write
    nothing, and the ids' range goes to the device's error record (errors.py): the host never
    waits for the check."""

    THREADS = 256

    @cute.jit
    def __call__(self, sorted_keys: cute.Tensor, ranges: cute.Tensor, sorted_ids: cute.Tensor,
                 record: cute.Tensor, vocab: Int32, ctas: Int32, stream: cuda.CUstream):
        self.kernel(sorted_keys, ranges, sorted_ids, record, vocab).launch(
            grid=[ctas, 1, 1], block=[self.THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, m_keys: cute.Tensor, m_ranges: cute.Tensor, m_sorted: cute.Tensor, m_record: cute.Tensor,
               vocab: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        for i in cutlass.range(bidx * self.THREADS + tidx, cute.size(m_keys), ctas * self.THREADS, unroll=4):
            m_sorted[i] = Int32(m_keys[i]) + KEY_SHIFT
        if bidx == 0 and tidx == 0:  # the thread that wrote position 0 above
            in_range = Int32(1)
            for c in cutlass.range_constexpr(RangeAndKeys.CTAS):
                if m_ranges[c, 0] < 0 or m_ranges[c, 1] >= Int64(vocab):
                    in_range = Int32(0)
            if in_range == 0:
                m_sorted[0] = Int32(-1)
                report_bad_ids(m_record, m_ranges, RangeAndKeys.CTAS, vocab)

    @staticmethod
    def ctas(tokens: int) -> int:
        """Enough CTAs for ~4 keys a thread."""
        return max(1, min(1024, -(-tokens // (4 * WidenKeys.THREADS))))


def build_widen_keys(arch: str, dump_dir=None):
    tokens = cute.sym_int32()
    return runtime.compile_kernel(
        ("widen keys",), WidenKeys(),
        runtime.fake_tensor(Int16, (tokens,), (1,), 2),
        runtime.fake_tensor(Int64, (RangeAndKeys.CTAS, 2), (2, 1), 16),
        runtime.fake_tensor(Int32, (tokens,), (1,), 4), runtime.fake_tensor(Int64, (errors.WORDS,), (1,), 8),
        Int32(1), Int32(1), runtime.env_stream(),
        arch=arch, dump_dir=dump_dir, tvm_ffi=True)


def build_range_and_keys(ids_dtype, arch: str, dump_dir=None):
    """RangeAndKeys for int64 or int32 ids (Int64 / Int32), called with torch tensors."""
    tokens = cute.sym_int32()
    return runtime.compile_kernel(
        ("range and keys", str(ids_dtype)), RangeAndKeys(),
        runtime.fake_tensor(ids_dtype, (tokens,), (1,), ids_dtype.width // 8),
        runtime.fake_tensor(Int16, (tokens,), (1,), 2),
        runtime.fake_tensor(Int64, (RangeAndKeys.CTAS, 2), (2, 1), 16), runtime.env_stream(),
        arch=arch, dump_dir=dump_dir, tvm_ffi=True)


AUDIT_BUILDS = {"embedding_rmsnorm_backward ids range and int16 keys": lambda arch, dump_dir:
                build_range_and_keys(Int64, arch, dump_dir),
                "embedding_rmsnorm_backward sorted keys widened": build_widen_keys}
# One 8-byte load and one 2-byte store an id (widening: a 2-byte load and a 4-byte store); no
# atomics (WidenKeys adds up the CTAs' ranges).
AUDIT_EXPECTS = {arch: {"require": ["LDG.64", "STG.16"], "forbid": ["LOCAL", "ATOM/RED"]} for arch in runtime.ARCHES}
AUDIT_EXPECTS_BY_BUILD = {"embedding_rmsnorm_backward sorted keys widened": {
    arch: {"require": ["LDG.16", "STG.32"], "forbid": ["LOCAL", "ATOM/RED"]} for arch in runtime.ARCHES}}
