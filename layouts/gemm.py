"""How a matrix product is cut into tiles: one description for the sm_90a and sm_100a builds.

C[M, N] = sum_k A[m, k] * B[n, k], bf16 operands, fp32 accumulation. The description is
plain data (hashable: it is part of the compile key) and knows nothing of either
architecture's MMA instructions; each arch module checks what it can run.
"""
from __future__ import annotations

import dataclasses

SM90_SMEM_BYTES = 232448 - 1024  # per CTA, minus the pipeline barriers and alignment slack


@dataclasses.dataclass(frozen=True)
class GemmTiling:
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 1
    epilogue_stages: int = 2
    # Persistent tile order: tiles go out in groups of `group_m` tile rows, walking M inside a
    # group, so CTAs working at the same time share B panels and a few A panels in L2.
    group_m: int = 8

    def check_sm90(self) -> None:
        """Raise ValueError unless a Hopper warpgroup-MMA kernel can use this tiling."""
        if self.tile_m not in (64, 128, 256):
            raise ValueError(f"tile_m must be 64, 128 or 256 on sm_90a, got {self.tile_m}")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256] on sm_90a, got {self.tile_n}")
        if self.tile_k != 64:
            raise ValueError(f"tile_k must be 64 (one 128-byte swizzle row of bf16), got {self.tile_k}")
        if self.cluster_m * self.cluster_n > 4 or any(c not in (1, 2, 4) for c in (self.cluster_m, self.cluster_n)):
            raise ValueError(f"cluster must be powers of two with at most 4 CTAs, got {self.cluster_m}x{self.cluster_n}")
        if self.group_m < 1:
            raise ValueError(f"group_m must be at least 1, got {self.group_m}")
        if self.mainloop_stages(SM90_SMEM_BYTES) < 2:
            raise ValueError(f"tile {self.tile_m}x{self.tile_n}x{self.tile_k} leaves no room for two stages")

    @property
    def mma_warpgroups(self) -> int:
        """Consumer warpgroups: one per 64 rows of the tile (a warpgroup MMA is 64 rows tall)."""
        return self.tile_m // 64

    def epilogue_tile(self) -> tuple[int, int]:
        """The piece of C staged through shared memory per TMA store."""
        return (min(self.tile_m, 128), min(self.tile_n, 32))

    def mainloop_stages(self, smem_bytes: int, c_bytes: int = 2) -> int:
        """As many A+B stages as fit next to the epilogue's staging buffers."""
        stage = (self.tile_m + self.tile_n) * self.tile_k * 2
        epilogue_m, epilogue_n = self.epilogue_tile()
        return (smem_bytes - self.epilogue_stages * epilogue_m * epilogue_n * c_bytes) // stage


def tile_coord(tile, tiles_m, tiles_n, group_m: int, minimum=min):
    """(m, n) of linear tile `tile` in grouped order: groups of `group_m` tile rows, M fastest
    inside a group. Kernels pass the DSL's `minimum` (cutlass.min) to run it on device integers."""
    per_group = group_m * tiles_n
    first_m = (tile // per_group) * group_m
    rows = minimum(tiles_m - first_m, group_m)
    within = tile % per_group
    return first_m + within % rows, within // rows


def default_tiling(m: int, n: int, k: int) -> GemmTiling:
    """A first heuristic until the tuner's table exists: big tiles when there are enough of
    them to fill the machine, smaller ones when the product is short in M or N."""
    if m >= 2048 and n >= 2048:
        return GemmTiling(tile_m=128, tile_n=256)
    if m <= 128 or n <= 128:
        return GemmTiling(tile_m=64, tile_n=128)
    return GemmTiling(tile_m=128, tile_n=128)
