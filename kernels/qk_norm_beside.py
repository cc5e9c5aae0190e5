"""051's norm rows beside the summed product's main loop (the sm_90a GEMM core's `beside`
warpgroup), instead of before it.

Before (`QkNormBackward` as the prologue), every CTA made its share of dq/dk, then a grid
barrier, then the MMAs: at T = 8192 the rows took ~25 of the call's ~84 us with the tensor
cores idle. Here one more warpgroup a CTA makes the rows while the MMAs run, and the producer
waits for the rows of each k-tile it loads:

- Flags: one int32 per (head, m-tile) counts the rows stored (q heads 0..H-1, then k). A
  warp adds 1 (release) after each row's stores; the producer spins (acquire) until the count
  is the m-tile's token count, then fences the async proxy before its TMA load.
- Order: the summed product's K runs v, q heads, k (the caller stacks the terms so), so its
  first k-tiles need no rows. Rows go out in bands of m-tiles about one wave of tiles tall
  (ceil(CTAs / N-tiles) m-tiles): a band's q head 0 rows first, then head 1, ..., then k,
  then the next band; inside that, tokens in order. That is the order the tiles of a wave ask
  for them.
- The norm-weight gradients: each CTA's rows warpgroup writes its partial row, counts itself
  done, waits for every CTA's, then adds its slice of the columns (`ColumnSumsInWarps`).
- Reset: after the producer's last load (`finish`), the CTAs count themselves out; the last
  one zeroes the flags and both counters for the next call.

counters (int32, zero between calls): [0] CTAs done with their partial rows, [1] CTAs out,
[2 + head * m_tiles + m] the flags.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from .column_sum import ColumnSumsInWarps
from .qk_norm_rows import QkNormBackward

BESIDE_SLOTS = 4  # rows in flight a warp (its ring in shared memory), at most
RING_BYTES = 24 * 1024  # the rings' shared memory (taken from the main loop's stages), at most
WARPS = 4  # one warpgroup
ROWS_BARRIER = 7  # the rows warpgroup's own named barrier (the GEMM core's use 1-6)
COUNTERS = 2  # counters before the flags


def flag_words(tokens: int, heads: int, tile_m: int = 64) -> int:
    """The counters' length for `tokens` (at the smallest tile_m a tiling takes)."""
    return COUNTERS + heads * -(-tokens // tile_m)


class QkNormBeside:
    """dq, dk and both norm-weight gradients from one warpgroup beside the summed product's
    main loop; see the module docstring."""

    def __init__(self, head_dim: int, q_heads: int, tile_m: int, tile_k: int, n_tiles: int):
        self.rows = QkNormBackward(head_dim)
        self.sums = ColumnSumsInWarps(2 * head_dim, head_dim)
        self.head_dim, self.q_heads, self.tile_m, self.tile_k, self.n_tiles = head_dim, q_heads, tile_m, tile_k, n_tiles
        self.heads = q_heads + 1

        self.slots = max(2, min(BESIDE_SLOTS, RING_BYTES // (self.rows.slot_bytes() * WARPS))) // 2 * 2
        self.together = self.slots // 2  # rows finished together (rows_in_turns)

    def scratch_bytes(self) -> int:
        """The warps' rings; the partial rows' exchange reuses them."""
        return max(self.rows.slot_bytes() * self.slots * WARPS, 4 * self.head_dim * WARPS)

    def arguments(self, norm_args, counters, grad_weight_q, grad_weight_k):
        """norm_args: QkNormBackward.arguments(...) (q side, k side, the partial rows)."""
        q, k, partial_rows = norm_args
        return q, k, partial_rows, counters, grad_weight_q, grad_weight_k

    @cute.jit
    def run(self, args, scratch, thread):
        q, k, partial_rows, counters, out_q, out_k = args
        lane, warp = thread % 32, thread // 32
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        atom = self.rows.atom()
        sides, rows_q, tokens, by_seq = self.rows.sides(q, k, atom, lane)
        m_tiles = (tokens + self.tile_m - 1) // self.tile_m
        band_tokens = (ctas + self.n_tiles - 1) // self.n_tiles * self.tile_m
        band_rows = band_tokens * self.heads
        flags = counters.iterator + COUNTERS
        seq = q[0].shape[0][0]

        def locate(r):
            band = r // band_rows
            first = band * band_tokens
            in_band = cutlass.min(band_tokens, tokens - first)
            j = r - band * band_rows
            head = j // in_band
            token = first + j - head * in_band
            b, s = divmod(token, by_seq)
            side = cutlass.select_(head < self.q_heads, Int32(0), Int32(1))
            return side, (s, cutlass.select_(head < self.q_heads, head, Int32(0)), b)

        # A release costs a MEMBAR.GPU, which waits for all of the thread's loads in flight (the
        # ring's next rows) as well: one per turn of the ring, for the turn's rows together.
        pending = cute.make_rmem_tensor((2 * self.together,), Int32)  # the flag of each slot's row (-1: none)
        pending.fill(-1)

        def stored(slot, side, coord):
            s, head, b = coord
            pending[slot] = (head + side * self.q_heads) * m_tiles + (s + b * seq) // self.tile_m

        def publish():
            # every lane's stores of the turn's rows, ordered before lane 0's fence by
            # bar.warp.sync; the reader fences the async proxy after its acquire
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.fence_acq_rel_gpu()
                for j in cutlass.range_constexpr(2 * self.together):
                    if pending[j] >= 0:
                        cute.arch.atomic_add(flags + pending[j], Int32(1), sem="relaxed", scope="gpu")
            pending.fill(-1)

        self.rows.rows_in_turns(atom, sides, locate, rows_q + tokens, scratch, bidx * WARPS + warp, ctas * WARPS,
                                lane, warp, WARPS, self.together, after_row=stored, after_turn=publish)
        sync = pipeline.NamedBarrier(barrier_id=ROWS_BARRIER, num_threads=WARPS * 32)
        sync.arrive_and_wait()  # the partial rows below reuse the other warps' rings
        across = cute.make_tensor(cute.recast_ptr(scratch, dtype=cutlass.Float32),
                                  cute.make_layout((self.head_dim, WARPS)))
        self.rows.partial_rows(sides, across, partial_rows[bidx, None], lane, warp, thread, WARPS * 32,
                               sync.arrive_and_wait)
        # every CTA's partial rows, then this CTA's slice of the column sums
        if thread == 0:
            cute.arch.atomic_add(counters.iterator, Int32(1), sem="release", scope="gpu")
            while cute.arch.load(counters.iterator, Int32, sem="acquire", scope="gpu") < ctas:
                pass
        sync.arrive_and_wait()
        self.sums.run((partial_rows, out_q, out_k), warp, WARPS)

    def producer_state(self):
        """The producer's memory of the last rows it waited for (m-tile and head)."""
        state = cute.make_rmem_tensor((1,), Int32)
        state[0] = -1
        return state

    @cute.jit
    def await_k_tile(self, args, term, m, kk, state):
        """Before the producer loads A's k-tile kk of term `term` (0 v, 1 q, 2 k) for tile row
        m: wait until the rows it covers are stored. A head's k-tiles after its first find the
        same flags set: no wait (each is an L2 round trip before the TMA load)."""
        q, k, _, counters, _, _ = args
        tokens = cute.size(k[0], mode=[0])
        if term > 0:
            first = kk * self.tile_k // self.head_dim
            last = cutlass.min((kk * self.tile_k + self.tile_k - 1) // self.head_dim, self.q_heads - 1)
            if term == 2:
                first, last = Int32(self.q_heads), Int32(self.q_heads)
            seen = m * (self.heads + 1) + last
            if m * self.tile_m < tokens and seen != state[0]:
                m_tiles = (tokens + self.tile_m - 1) // self.tile_m
                rows = cutlass.min(self.tile_m, tokens - m * self.tile_m)
                for head in cutlass.range(first, last + 1):
                    flag = counters.iterator + COUNTERS + head * m_tiles + m
                    while cute.arch.load(flag, Int32, sem="acquire", scope="gpu") < rows:
                        pass
                cute.arch.fence_proxy("async.global")  # the TMA loads below see the rows
                state[0] = seen

    @cute.jit
    def finish(self, args, thread):
        """After this CTA's producer has made its last load: count the CTA out; the last one
        zeroes the flags and counters for the next call (every other CTA is past its waits)."""
        q, k, _, counters, _, _ = args
        if thread < 32:
            ctas, _, _ = cute.arch.grid_dim()
            out = Int32(0)
            if thread == 0:
                out = cute.arch.atomic_add(counters.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
            out = cute.arch.shuffle_sync(out, 0)
            if out == ctas - 1:
                tokens = cute.size(k[0], mode=[0])
                words = COUNTERS + self.heads * ((tokens + self.tile_m - 1) // self.tile_m)
                for i in cutlass.range(thread, words, 32):
                    counters[i] = Int32(0)
