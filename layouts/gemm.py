"""How a matrix product is cut into tiles: one description for the sm_90a and sm_100a builds.

C[M, N] = sum_k A[m, k] * B[n, k], bf16 operands, fp32 accumulation. The description is
plain data (hashable: it is part of the compile key) and knows nothing of either
architecture's MMA instructions; each arch module checks what it can run.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path

from .gpus import SMEM_PER_BLOCK, Gpu

SM90_SMEM_BYTES = SMEM_PER_BLOCK["sm_90a"] - 1024  # per CTA, minus the pipeline barriers and alignment slack
SM100_SMEM_BYTES = SMEM_PER_BLOCK["sm_100a"] - 1024
WARPGROUP_THREADS = 128
# A fused product with K up to SHORT_K is epilogue-bound: its epilogue inputs load this many
# pieces ahead (default_tiling).
SHORT_K = 512
SHORT_K_INPUT_STAGES = 8
# Hopper: fp32 accumulators a consumer thread may hold (cooperative, pingpong); the rest of its
# 232 registers (setmaxnreg) go to addresses, the epilogue's pieces and the stream-K hand-over.
# Pingpong keeps more state live across its loop (turns, skipped stages): at 160, ptxas spilled
# two addresses (the audit's LOCAL check), so it stops at 128.
MAX_ACCUMULATORS = {False: 160, True: 128}


_SPEC = re.compile(r"(\d+)x(\d+)(?:c(\d+)x(\d+))?(p)?(s)?(?:w(\d+))?")


@dataclasses.dataclass(frozen=True)
class GemmTiling:
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 1
    epilogue_stages: int = 2
    # Hopper fused epilogues: slots of input pieces per team, TMA-loaded ahead (the first ones
    # while the tile's MMAs run); see staging_buffers.
    epilogue_input_stages: int = 2
    # Persistent tile order: tiles go out in groups of `group_m` tile rows, walking M inside a
    # group, so CTAs working at the same time share B panels and a few A panels in L2.
    group_m: int = 8
    # Fewer tiles than SMs: deal their k-iterations out over every SM (split-K, through the
    # stream-K hand-over) instead of one CTA per tile. A host-side schedule choice: the
    # kernel is the same.
    split_k: bool = False
    # Hopper: the two consumer warpgroups take whole tiles in turn ("pingpong"), so one's
    # epilogue runs under the other's MMAs; off, both work one tile together ("cooperative").
    pingpong: bool = False
    # Hopper: columns of C in each piece the epilogue stages through shared memory and stores by
    # TMA (at most tile_n). Wider pieces mean fewer stores and barriers a tile: what a product
    # with a short K is made of (epilogue_tile).
    epilogue_n: int = 32

    @property
    def spec(self) -> str:
        """Short name: '128x256c2x1' (tile, cluster), then 'p' for pingpong, 's' for split_k,
        'w128' for 128-column epilogue pieces; the other fields at their defaults. `from_spec`
        reads it back."""
        cluster = f"c{self.cluster_m}x{self.cluster_n}" if (self.cluster_m, self.cluster_n) != (1, 1) else ""
        wide = f"w{self.epilogue_n}" if self.epilogue_n != GemmTiling.epilogue_n else ""
        return f"{self.tile_m}x{self.tile_n}{cluster}{'p' if self.pingpong else ''}{'s' if self.split_k else ''}{wide}"

    @classmethod
    def from_spec(cls, text: str) -> "GemmTiling":
        match = _SPEC.fullmatch(text.strip())
        if not match:
            raise ValueError(f"a tiling spec is TILE_MxTILE_N[cCLUSTER_MxCLUSTER_N][p][s][wEPILOGUE_N], "
                             f"e.g. 128x128c2x1p; got {text!r}")
        tile_m, tile_n, cluster_m, cluster_n, pingpong, split_k, epilogue_n = match.groups()
        return cls(tile_m=int(tile_m), tile_n=int(tile_n), cluster_m=int(cluster_m or 1), cluster_n=int(cluster_n or 1),
                   pingpong=bool(pingpong), split_k=bool(split_k), epilogue_n=int(epilogue_n or cls.epilogue_n))

    def check_sm90(self) -> None:
        """Raise ValueError unless a Hopper warpgroup-MMA kernel can use this tiling."""
        if self.tile_m not in (64, 128, 256):
            raise ValueError(f"tile_m must be 64, 128 or 256 on sm_90a, got {self.tile_m}")
        # A multiple of the epilogue's 32-column store pieces: the warpgroup MMA would take
        # multiples of 16, but 64 x 80 tiles measured wrong results (a piece past the tile).
        if self.tile_n % 32 or not 32 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 32 in [32, 256] on sm_90a, got {self.tile_n}")
        self._check_k_cluster_order(max_cluster=4)
        if self.epilogue_n not in (32, 64, 128) or self.tile_n % self.epilogue_tile()[1]:
            raise ValueError(f"epilogue_n must be 32, 64 or 128 and its pieces must divide tile_n {self.tile_n}, "
                             f"got {self.epilogue_n}")
        accumulators = self.tile_m * self.tile_n // (WARPGROUP_THREADS * self.tile_warpgroups)
        most = MAX_ACCUMULATORS[self.pingpong]
        if accumulators > most:
            raise ValueError(f"tile {self.tile_m}x{self.tile_n}{' (pingpong)' if self.pingpong else ''} needs "
                             f"{accumulators} fp32 accumulator registers a thread; at most {most} fit")
        if self.mainloop_stages(SM90_SMEM_BYTES) < 2:
            raise ValueError(f"tile {self.tile_m}x{self.tile_n}x{self.tile_k} leaves no room for two stages")

    def check_sm100(self) -> None:
        """Raise ValueError unless the Blackwell (tcgen05) kernel can use this tiling."""
        if self.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128 on sm_100a (a 2-CTA pair makes 256), got {self.tile_m}")
        if self.tile_n % 32 or not 32 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 32 in [32, 256] on sm_100a, got {self.tile_n}")
        if self.pingpong:
            raise ValueError("pingpong is a Hopper (warpgroup MMA) schedule; sm_100a overlaps epilogues "
                             "through its two tensor-memory accumulators")
        if self.epilogue_n != GemmTiling.epilogue_n:
            raise ValueError("epilogue_n is the Hopper epilogue's piece width; sm_100a picks its own subtiles")
        self._check_k_cluster_order(max_cluster=8)

    def _check_k_cluster_order(self, max_cluster: int) -> None:
        """What both arches ask of tile_k, the cluster (powers of two, at most `max_cluster`
        CTAs) and the tile order."""
        if self.tile_k != 64:
            raise ValueError(f"tile_k must be 64 (one 128-byte swizzle row of bf16), got {self.tile_k}")
        powers = [1 << i for i in range(max_cluster.bit_length())]
        if self.cluster_m * self.cluster_n > max_cluster or any(c not in powers for c in (self.cluster_m, self.cluster_n)):
            raise ValueError(f"cluster must be powers of two with at most {max_cluster} CTAs, "
                             f"got {self.cluster_m}x{self.cluster_n}")
        if self.group_m < 1:
            raise ValueError(f"group_m must be at least 1, got {self.group_m}")

    @property
    def two_cta_mma(self) -> bool:
        """Blackwell: CTA pairs along M run 2-CTA MMAs (one 256-row MMA tile, cta_group::2)
        when the cluster has pairs along M and each CTA's tile is 128 rows."""
        return self.cluster_m % 2 == 0 and self.tile_m == 128

    @property
    def mma_warpgroups(self) -> int:
        """Consumer warpgroups: two (a warpgroup MMA is 64 rows tall; a 256-row tile gives each
        warpgroup two 64-row blocks), one for a 64-row cooperative tile."""
        return 1 if self.tile_m == 64 and not self.pingpong else 2

    @property
    def tile_warpgroups(self) -> int:
        """Consumer warpgroups working on one tile."""
        return 1 if self.pingpong else self.mma_warpgroups

    def cluster_tiles(self, m: int, n: int) -> int:
        """Cluster tiles (cluster_m x cluster_n CTA tiles) covering an [m, n] C."""
        return -(-m // (self.tile_m * self.cluster_m)) * -(-n // (self.tile_n * self.cluster_n))

    def epilogue_tile(self) -> tuple[int, int]:
        """The piece of C staged through shared memory per TMA store: the rows the tile's
        warpgroups cover in one store (64 each), epilogue_n columns (at most the tile's)."""
        return (64 * self.tile_warpgroups, min(self.tile_n, self.epilogue_n))

    def epilogue_buffers(self) -> int:
        """Shared-memory staging buffers of C: `epilogue_stages` for each team storing on its own."""
        return self.epilogue_stages * (2 if self.pingpong else 1)

    def staging_buffers(self, inputs: int = 0, outputs: int = 1) -> int:
        """C's shared-memory pieces, both arches: `epilogue_buffers()` for the plain store; for a
        fused epilogue with `inputs` extra inputs, slots in their place: each team has a ring of
        `epilogue_input_stages` slots, a slot holding a piece of every input (TMA-loaded ahead),
        then the same piece of every output (written over the inputs once they are read,
        TMA-stored from there)."""
        if not inputs:
            return self.epilogue_buffers()
        return (2 if self.pingpong else 1) * self.epilogue_input_stages * max(inputs, outputs)

    def mainloop_stages(self, smem_bytes: int, c_bytes: int = 2, inputs: int = 0, outputs: int = 1) -> int:
        """As many A+B stages as fit next to the epilogue's staging buffers (of a fused
        epilogue with `inputs` extra bf16 inputs and `outputs` results, if any)."""
        stage = (self.tile_m + self.tile_n) * self.tile_k * 2
        epilogue_m, epilogue_n = self.epilogue_tile()
        return (smem_bytes - self.staging_buffers(inputs, outputs) * epilogue_m * epilogue_n * c_bytes) // stage


def tile_coord(tile, tiles_m, tiles_n, group_m: int, minimum=min):
    """(m, n) of linear tile `tile` in grouped order: groups of `group_m` tile rows, M fastest
    inside a group. Kernels pass the DSL's `minimum` (cutlass.min) to run it on device integers."""
    per_group = group_m * tiles_n
    first_m = (tile // per_group) * group_m
    rows = minimum(tiles_m - first_m, group_m)
    within = tile % per_group
    return first_m + within % rows, within // rows


# Stream-K does not pay on short K, where a partial tile's hand-over costs a few k-tiles of MMAs:
# measured on the H200, it cost 3-12% at 8 and 20 k-tiles and paid from 32 (docs/design-gemm.md).
MIN_K_TILES = 32
# Split-K for a single product of few tiles (default_tiling's group_n rule): at most half the
# SMs' worth of tiles, so each tile's K is cut at least in two, and K of at least MIN_K_TILES
# whole k-tiles, so the hand-over pays.
SPLIT_MIN_K = MIN_K_TILES * GemmTiling.tile_k
# default_tiling: a batch of per-head inverse-RoPE products up to this K takes 64-row pingpong
# tiles; so does a batch of sums whose 128-row tiles fill at most half the SMs.
SHORT_ROPE_K = 1024
# default_tiling, sm_90a: a product this short in K (weight gradients of a short batch: K = T)
# is its epilogue, so 128-column store pieces (a quarter of the stores and barriers a tile).
# H200, graph replay turn by turn, us, 32 / 64 / 128 columns (pingpong 128 x 128 in 2 x 1
# clusters), C [5120, 5120] from M-major operands: K = 128 21.7 / 19.7 / 19.2, K = 256 30.2 /
# 28.4 / 27.1, K = 512 46.5 / 47.2 / 49.2, K = 1024 87.4 / 87.4 / 91.5; the decoder layer's
# grouped q/k/v weight gradients at T = 128 34.0 / 28.2 / 27.1, at T = 512 68.3 / 65.8 / 70.8.
WIDE_EPILOGUE_MAX_K = 256
WIDE_EPILOGUE_N = 128


def default_tiling(m: int, n: int, k: int, gpu: Gpu, fused: int = 0, group_n: int | None = None, batches: int = 1,
                   summed: int = 1, side_tensors: bool = False) -> GemmTiling:
    """The tiling for a product until the tuner's table exists: rules read off two sweeps of
    the decoder-layer products on the H200 (docs/design-gemm.md), each within ~10% of
    that product's best of the tilings tried.
    - M <= 128 (input gradients of a short batch, memory-bound on the weight): 128 x 128 from
      N >= 8192; else, for M > 64, 64 x 128 tiles in 2 x 1 clusters (both 64-row halves, one
      weight tile multicast to the pair: twice the CTAs pulling the weight), else 128 x 64;
    - sm_90a, one wave of 256 x 160 tiles (at most a sixth of the SMs idle: from five sixths of
      the H200's SM count to all of it; dX T=8192 of 1536 x 640): those, with no ragged wave to cut up (sm_100a CTA
      tiles stop at 128 rows);
    - C of at most ~1M elements (the 1536 x 640 products): 64 x 128 tiles, many of them;
    - 128 x 160 tiles in 2 x 1 clusters where 160 divides N and M <= 1024 (fewer tiles: the
      short-M products of N = 5120 fit one wave, one tile a CTA);
    - pingpong 128 x 128 tiles in 2 x 1 clusters where K <= 2048 (few k-tiles, so each tile's
      epilogue is a large share): one warpgroup's epilogue runs under the other's MMAs
      (sm_100a: the same tiles cooperative; its two tensor-memory accumulators overlap
      epilogues);
    - otherwise cooperative in 2 x 1 clusters (B multicast): 128 x 256 tiles where there are
      many of them (>= 800, or >= 300 with K > 2048 to amortize each tile's fill and
      epilogue), else 128 x 128 (finer tiles, a shorter ragged wave).
    `fused`: how many [M, N] inputs the epilogue reads (0: none). From M > 128 on sm_90a,
    pingpong 128 x 128 in 2 x 1 clusters, whose epilogues run under the other warpgroup's MMAs:
    for the decoder layer's g_sw product (T = 2048, 8192) 1.09 / 1.08x the plain product against
    1.12 / 1.18x with the cooperative 128 x 256 tiles, and faster in absolute time for 'add' too
    (docs/design-gemm.md); with K <= SHORT_K and one input (softmax_bwd's P; 'add' too, its C
    read as the input, not timed that way), eight slots of input pieces instead of two.
    `group_n`: tiles exactly that many columns wide (`row_dot` sums rows per tile,
    `rope_inverse` rotates one head a tile): 128-row tiles, pingpong on sm_90a where its
    accumulators fit (<= 128 columns), 2 x 1 clusters from M > 128. A single product of at most
    half the SMs' worth of such tiles with K >= SPLIT_MIN_K deals its k-iterations out over every
    SM (split_k): the decoder layer's g_ao (row_dot, N = K = 5120, 160-column tiles) at 128 / 256
    tokens, 32 / 64 tiles, took 37.6 / 38.4 us one CTA a tile and 29.0 / 32.5 split (cuBLAS's
    plain product 20.3 / 26.0); at 422 and 613 tokens (128 and 160 tiles) the split lost (50.6 /
    74.5 against 47.2 / 58.2).
    `batches` > 1 (a batched product, the decoder layer's attention: hundreds of [s, d] products
    per call, so the batch fills the SMs, not the tile size) and N at most 256: one tile spans N,
    128 rows, cooperative, 2 x 1 clusters from M > 128 (half the time of the single-product
    rule's 64 x 128 tiles on P . v and dv). A batch of `group_n` products (the decoder layer's
    per-head dq, inverse RoPE) with K <= SHORT_ROPE_K on sm_90a: 64-row pingpong tiles in 2 x 1
    clusters, one warpgroup's table loads and rotation under the other's MMAs; for a batch sum
    (gemm.batched's group_sum) K is the sum's, so dk summed over a kv head's query heads keeps
    the default. A batch of sums (`summed` > 1 products each) whose 128-row tiles would fill at
    most half the SMs: 64-row pingpong tiles, twice the CTAs on the long summed K. Measured in
    docs/design-decoder-layer.md.
    `side_tensors`: the epilogue moves per-row values or tables by plain loads (softmax_bwd,
    row_dot, rope_inverse); on Blackwell those take one accumulator row a thread, so 128-row
    tiles (gemm.sm100), 2 x 1 clusters (2-CTA MMAs) from M > 128.
    `gpu`: the rules' arch and SM count (the tile-count limits were read off the H200's SM count)."""
    arch, half_the_sms = gpu.arch, gpu.sms // 2
    if summed > 1 and batches * -(-m // 128) <= half_the_sms and n <= 256 and n % 32 == 0 and arch == "sm_90a":
        return GemmTiling(tile_m=64, tile_n=n, cluster_m=2, pingpong=True)
    if group_n and batches > 1 and k <= SHORT_ROPE_K and arch == "sm_90a":
        return GemmTiling(tile_m=64, tile_n=group_n, cluster_m=2, pingpong=True)
    if group_n:
        return GemmTiling(tile_m=128, tile_n=group_n, cluster_m=2 if m > 128 else 1,
                          pingpong=arch == "sm_90a" and group_n <= 128,
                          split_k=batches == 1 and k >= SPLIT_MIN_K and -(-m // 128) * -(-n // group_n) <= half_the_sms)
    if side_tensors and arch != "sm_90a":
        return GemmTiling(tile_m=128, tile_n=128, cluster_m=2 if m > 128 else 1)
    if batches > 1 and not fused and n <= 256 and n % 32 == 0:
        return GemmTiling(tile_m=128, tile_n=n, cluster_m=2 if m > 128 else 1)
    if m <= 128 and n >= 8192:
        return GemmTiling(tile_m=128, tile_n=128)
    if 64 < m <= 128:
        return GemmTiling(tile_m=64, tile_n=128, cluster_m=2)
    if m <= 64:
        return GemmTiling(tile_m=128, tile_n=64)
    if fused and arch == "sm_90a":
        # Short K (the decoder layer's softmax_bwd, K = head_dim: three k-tiles): the epilogue is
        # the work, so eight slots of input pieces (the whole tile) load ahead instead of two,
        # taking shared memory the short main loop does not need. One input only (softmax_bwd, and
        # 'add', whose short-K speed was not timed): dSwiGLU's three inputs in eight slots would
        # leave the main loop one stage. g_s at 449 x 16: 0.204 ms against 0.279 (256 x 32: 0.141
        # against 0.179).
        return GemmTiling(tile_m=128, tile_n=128, cluster_m=2, pingpong=True,
                          epilogue_input_stages=SHORT_K_INPUT_STAGES if k <= SHORT_K and fused == 1 else 2)
    if gpu.sms - gpu.sms // 6 <= -(-m // 256) * -(-n // 160) <= gpu.sms and arch == "sm_90a":
        return GemmTiling(tile_m=256, tile_n=160)
    if m * n <= 1536 * 640 and m < 4096:
        return GemmTiling(tile_m=64, tile_n=128)
    if m <= 1024 and n % 160 == 0:
        return GemmTiling(tile_m=128, tile_n=160, cluster_m=2)
    if k <= 2048:
        return GemmTiling(tile_m=128, tile_n=128, cluster_m=2, pingpong=arch == "sm_90a",
                          epilogue_n=WIDE_EPILOGUE_N if k <= WIDE_EPILOGUE_MAX_K and arch == "sm_90a"
                          else GemmTiling.epilogue_n)
    wide_tiles = -(-m // 128) * -(-n // 256)
    if wide_tiles >= 800 or wide_tiles >= 300 and k >= 2048:
        return GemmTiling(tile_m=128, tile_n=256, cluster_m=2)
    return GemmTiling(tile_m=128, tile_n=128, cluster_m=2)


def even_clusters(tiling: GemmTiling, m: int, n: int, arch: str = "sm_90a") -> GemmTiling:
    """A rule's or the tuner's tiling (both read off token counts of an even number of 128-row
    tiles) fitted to this M: a 2 x 1 cluster over an odd count of tile rows leaves one CTA of
    its last cluster row without a tile for the whole K loop (613 tokens: five rows, three
    cluster rows, 1/6 of the CTAs idle). Such a cluster turns to 1 x 2 (the pair shares the A
    tile instead of B's) where N's tile count is even, else goes. sm_90a only: sm_100a's 2 x 1
    pairs run one 2-CTA MMA, a different trade, and no Blackwell GPU is here to time it.
    Swept on the H200, ms (2 x 1 / 1 x 2 / none; cuBLAS):
    - 613 tokens, go . Wd (N = 14336, K = 5120), 128 x 256: 0.168 / 0.146 / 0.148 (0.143);
      128 x 128 pingpong: 0.225 / 0.152 / 0.180;
    - 1382 tokens, the same, 128 x 128 pingpong: 0.403 / 0.302 / 0.357 (0.274);
      gate . Wg (K = 14336): 0.392 / 0.316 / 0.350 (0.317);
    - even counts keep 2 x 1, which was faster there: 422 tokens, go . Wd 128 x 256
      0.135 / 0.161 / 0.158."""
    if arch != "sm_90a" or (tiling.cluster_m, tiling.cluster_n) != (2, 1) or -(-m // tiling.tile_m) % 2 == 0:
        return tiling
    return dataclasses.replace(tiling, cluster_m=1, cluster_n=2 if -(-n // tiling.tile_n) % 2 == 0 else 1)


# The tuner's tables (tools/tune.py): per arch, the measured best tiling of each plain product's
# shape bucket. Dispatch takes a user's table (written by the tuner on the user's machine), then
# the shipped one, then the rules above.
TUNED_DIR = Path(__file__).resolve().parent / "tuned"
USER_TUNED_ENV = "CUTEBWD_TUNED_DIR"


def user_tuned_dir() -> Path:
    """Where the tuner writes, and dispatch reads first: $CUTEBWD_TUNED_DIR, else `tuned` in the
    compile cache's folder (kernels.disk_cache.user_directory); never the installed package."""
    from ..kernels.disk_cache import user_directory

    value = os.environ.get(USER_TUNED_ENV)
    return Path(value) if value else user_directory() / "tuned"


def shape_bucket(m: int, n: int, k: int, a_k_major: bool, b_k_major: bool) -> str:
    """A product's key in the tuned table: M and K (the token-count dimensions of a layer's
    products) rounded up to a power of two from 64, N exact (tile widths divide it or not),
    and the operands' majors ('k' or 'm'), which pick different builds."""
    def up(x):
        return max(64, 1 << (x - 1).bit_length())

    return f"{up(m)}x{n}x{up(k)} {'k' if a_k_major else 'm'}{'k' if b_k_major else 'm'}"


@functools.lru_cache(maxsize=None)
def tuned_table(arch: str) -> dict:
    """{bucket: entry}: the user's table's entries over the shipped layouts/tuned/<arch>.json's
    ({} where the tuner has run nowhere)."""
    entries = {}
    for path in (TUNED_DIR / f"{arch}.json", user_tuned_dir() / f"{arch}.json"):
        if path.exists():
            entries.update(json.loads(path.read_text())["entries"])
    return entries


def tuned_tiling(m: int, n: int, k: int, a_k_major: bool, b_k_major: bool, arch: str) -> GemmTiling | None:
    """The tuner's pick for the product's bucket, or None: also where the pick was the rules'
    own pick of the tuner's run (`default`), so a rule measured since then decides there."""
    entry = tuned_table(arch).get(shape_bucket(m, n, k, a_k_major, b_k_major))
    if entry is None or entry["tiling"] == entry.get("default"):
        return None
    return GemmTiling.from_spec(entry["tiling"])


# Stream-K (hybrid): the first `dp_tiles` tiles go out whole, round-robin (tile = cta + u * ctas);
# the last `tiles - dp_tiles` tiles are cut into k-iterations dealt out evenly, `per` consecutive
# iterations to each CTA, so the last wave has no idle SMs. A tile cut between CTAs is finished
# by the CTA holding its last k-iteration, which adds the others' fp32 partial tiles in CTA
# order (a fixed order: the result is bitwise repeatable). Every CTA works its stream-K range
# last tile first, so the partial it hands on is ready early and the finisher waits little.
# The functions below are plain integer arithmetic: kernels pass the DSL's min/max and run them
# on device integers.

def stream_k_range(cta, per, total, minimum=min):
    """[start, end) of the CTA's k-iterations in the stream-K region (`total` iterations)."""
    start = minimum(cta * per, total)
    return start, minimum(start + per, total)


def stream_k_count(start, end, k_tiles):
    """How many tiles the CTA's range [start, end) touches (0 for an empty range at a tile edge,
    which is where empty ranges always are: `total` is a multiple of k_tiles)."""
    return (end + k_tiles - 1) // k_tiles - start // k_tiles


def stream_k_segment(s, start, end, k_tiles, minimum=min, maximum=max):
    """(tile within the stream-K region, first k-tile, end k-tile) of the CTA's s-th segment,
    counting from its range's last tile."""
    tile = (end + k_tiles - 1) // k_tiles - 1 - s
    return tile, maximum(start - tile * k_tiles, 0), minimum(end - tile * k_tiles, k_tiles)


def stream_k_plan(tiles: int, k_tiles: int, ctas: int, min_iterations: int = 4,
                  min_k_tiles: int = 1) -> tuple[int, int]:
    """(dp_tiles, per) for `tiles` output tiles of `k_tiles` k-iterations on `ctas` persistent
    CTAs. Whole waves stay data-parallel; a ragged last wave and one full wave before it (so
    each CTA's range spans at most two tiles) go stream-K, unless a CTA's share would be under
    `min_iterations` k-iterations or a tile has fewer than `min_k_tiles` (fix-up traffic would
    outweigh the balance). per == 0: no stream-K."""
    if tiles % ctas == 0 or k_tiles < min_k_tiles:
        return tiles, 0
    sk_tiles = tiles % ctas + (ctas if tiles > ctas else 0)
    per = -(-sk_tiles * k_tiles // ctas)
    if per < min_iterations:
        return tiles, 0
    return tiles - sk_tiles, per


def cta_work(cta: int, ctas: int, tiles: int, k_tiles: int, dp_tiles: int, per: int):
    """The (tile, k_begin, k_end) units CTA `cta` works, in order: what the kernel's producer
    and consumers walk (the reference the tests check the schedule with)."""
    units = [(tile, 0, k_tiles) for tile in range(cta, dp_tiles, ctas)]
    start, end = stream_k_range(cta, per, (tiles - dp_tiles) * k_tiles)
    for s in range(stream_k_count(start, end, k_tiles)):
        tile, k_begin, k_end = stream_k_segment(s, start, end, k_tiles)
        units.append((dp_tiles + tile, k_begin, k_end))
    return units
