"""GEMM core: the tiling description on any machine; the sm_90a kernel on the GPU.

The kernel is work in progress: it compiles and passes the audit, and these GPU tests have
not been run yet."""
import pytest
import torch

from cutebwd.layouts.gemm import GemmTiling, default_tiling, tile_coord


@pytest.mark.parametrize("tiles_m,tiles_n,group_m", [(1, 1, 8), (7, 5, 8), (16, 3, 4), (5, 9, 1), (3, 4, 8)])
def test_grouped_order_visits_every_tile_once(tiles_m, tiles_n, group_m):
    coords = [tile_coord(t, tiles_m, tiles_n, group_m) for t in range(tiles_m * tiles_n)]
    assert sorted(coords) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]


def test_grouped_order_walks_m_inside_a_group():
    assert [tile_coord(t, 16, 3, 4) for t in range(5)] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]


def test_sm90_tiling_checks():
    for tiling in (GemmTiling(), GemmTiling(tile_n=256), GemmTiling(tile_m=64, tile_n=64)):
        tiling.check_sm90()
    for bad in (GemmTiling(tile_m=96), GemmTiling(tile_n=264), GemmTiling(tile_k=32), GemmTiling(cluster_m=3)):
        with pytest.raises(ValueError):
            bad.check_sm90()


def test_default_tiling_is_valid_for_the_layer_products():
    for m, n, k in ((128, 5120, 5120), (8192, 14336, 5120), (5120, 5120, 8192), (640, 1536, 8192)):
        default_tiling(m, n, k).check_sm90()


def _reference(a, b):
    return (a.float() @ b.float().t())


@pytest.mark.gpu
@pytest.mark.parametrize("a_view,b_view", [("k", "n"), ("m", "n"), ("k", "k")])
@pytest.mark.parametrize("m,n,k", [(128, 128, 64), (296, 520, 64), (1000, 776, 1000), (2048, 5120, 512)])
def test_matches_an_fp32_matmul(a_view, b_view, m, n, k):
    """Sizes that are not tile multiples (TMA bounds), K = 64 (one k-tile), both operand
    majors; extents stay multiples of 8 because TMA needs 16-byte strides."""
    from cutebwd.kernels.gemm_sm90 import matmul_nt

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16() if a_view == "k" else \
        torch.randn(k, m, device="cuda", generator=g).bfloat16().t()
    b = torch.randn(n, k, device="cuda", generator=g).bfloat16() if b_view == "k" else \
        torch.randn(k, n, device="cuda", generator=g).bfloat16().t()
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    matmul_nt(a, b, out=out)
    ref = _reference(a, b)
    assert not out.isnan().any()
    assert torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref) < 1e-2
