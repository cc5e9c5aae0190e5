"""A call's token ids sorted in one CTA's shared memory: 087's index pass for small calls.

key = id << TOKEN_BITS | token is unique per token, so sorting the keys ascending groups the
tokens by id, each group in token order: what a stable sort of the ids gives, fixed by the
ids alone (bitwise repeatable sums downstream). A bitonic network over the next power of two
(pads sort last), one barrier a step: log2(n) (log2(n) + 1) / 2 steps, 28 at 128 tokens.
Every CTA sorts for itself, so the index pass costs no launch and no host work.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

TOKEN_BITS = 10
MAX_TOKENS = 1 << TOKEN_BITS
PAD = 2**31 - 1  # sorts after every real key
# Real keys stay below PAD, and PAD's id (PAD >> TOKEN_BITS) lies outside the vocabulary.
MAX_VOCAB = (PAD >> TOKEN_BITS) - 1


@cute.jit
def sort_ids(smem, m_ids: cute.Tensor, vocab, m_publish: cute.Tensor, publish, tidx, threads: cutlass.Constexpr):
    """-> (in_range, sorted ids, order): the last two shared-memory Int32 tensors of the call's
    token count. in_range is 0 when an id lies outside [0, vocab) (the views are then
    meaningless, but their last id lies outside the vocabulary too). Where `publish` is
    nonzero the sorted ids also go to global m_publish, for a later kernel."""
    tokens = cute.size(m_ids)
    keys = smem.allocate_tensor(Int32, cute.make_layout((MAX_TOKENS,)), byte_alignment=16)
    order = smem.allocate_tensor(Int32, cute.make_layout((MAX_TOKENS,)), byte_alignment=16)
    bad_ids = smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=16)
    n = Int32(1)
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
    # Bitonic merge steps (k, j): pair t compares keys i and i + j, i = (t / j) 2j + t % j,
    # ascending where bit k of i is clear.
    k = Int32(2)
    while k <= n:
        j = k // 2
        while j > 0:
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
        k = k * 2
    for i in cutlass.range(tidx, tokens, threads):
        key = keys[i]
        order[i] = key & (MAX_TOKENS - 1)
        keys[i] = key >> TOKEN_BITS
        if publish != 0:
            m_publish[i] = key >> TOKEN_BITS
    cute.arch.barrier()
    in_range = 1 - bad_ids[0]
    return (in_range, cute.make_tensor(keys.iterator, cute.make_layout(tokens)),
            cute.make_tensor(order.iterator, cute.make_layout(tokens)))
