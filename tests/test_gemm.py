"""GEMM core: the tiling description and argument errors on any machine; the sm_90a kernel
on the GPU."""
import dataclasses

import pytest
import torch

from cutebwd.layouts.gemm import GemmTiling, default_tiling, even_clusters, tile_coord
from cutebwd.tools.gpus import B200, H200
from cutebwd.tools.parity import relative_error


@pytest.mark.parametrize("tiles_m,tiles_n,group_m", [(1, 1, 8), (7, 5, 8), (16, 3, 4), (5, 9, 1), (3, 4, 8)])
def test_grouped_order_visits_every_tile_once(tiles_m, tiles_n, group_m):
    coords = [tile_coord(t, tiles_m, tiles_n, group_m) for t in range(tiles_m * tiles_n)]
    assert sorted(coords) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]


def test_grouped_order_walks_m_inside_a_group():
    assert [tile_coord(t, 16, 3, 4) for t in range(5)] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]


def test_sm90_tiling_checks():
    for tiling in (GemmTiling(), GemmTiling(tile_n=256), GemmTiling(tile_m=64, tile_n=64),
                   GemmTiling(pingpong=True, cluster_m=2), GemmTiling(tile_m=64, tile_n=256, pingpong=True)):
        tiling.check_sm90()
    for bad in (GemmTiling(tile_m=96), GemmTiling(tile_n=264), GemmTiling(tile_k=32), GemmTiling(cluster_m=3),
                GemmTiling(tile_n=256, pingpong=True), GemmTiling(tile_m=256, tile_n=256),
                GemmTiling(tile_m=256, tile_n=128, pingpong=True), GemmTiling(tile_n=160, pingpong=True),
                GemmTiling(tile_m=64, tile_n=80, cluster_m=2), GemmTiling(tile_n=16)):  # 64x80: wrong on the H200
        with pytest.raises(ValueError):
            bad.check_sm90()
    for bad in (GemmTiling(epilogue_n=96), GemmTiling(tile_n=160, epilogue_n=64), GemmTiling(tile_n=192, epilogue_n=128)):
        with pytest.raises(ValueError, match="epilogue_n"):
            bad.check_sm90()
    with pytest.raises(ValueError, match="epilogue_n"):
        GemmTiling(epilogue_n=128).check_sm100()
    pingpong = GemmTiling(pingpong=True)
    assert (pingpong.mma_warpgroups, pingpong.tile_warpgroups, pingpong.epilogue_tile()) == (2, 1, (64, 32))
    assert GemmTiling(pingpong=True, epilogue_n=128).epilogue_tile() == (64, 128)
    assert GemmTiling(tile_n=64, epilogue_n=128).epilogue_tile() == (128, 64)
    wide = GemmTiling(tile_m=128, tile_n=128, cluster_m=2, pingpong=True, epilogue_n=128)
    assert wide.spec == "128x128c2x1pw128" and GemmTiling.from_spec(wide.spec) == wide
    for tiling, shape in ((GemmTiling(), (2, 2, (128, 32))), (GemmTiling(tile_m=256, tile_n=160), (2, 2, (128, 32))),
                          (GemmTiling(tile_m=64), (1, 1, (64, 32)))):
        assert (tiling.mma_warpgroups, tiling.tile_warpgroups, tiling.epilogue_tile()) == shape


def test_short_k_products_store_wide_epilogue_pieces():
    """K <= WIDE_EPILOGUE_MAX_K (a short batch's weight gradients): 128-column store pieces on
    sm_90a; longer K and sm_100a keep the default."""
    from cutebwd.layouts.gemm import WIDE_EPILOGUE_MAX_K, WIDE_EPILOGUE_N

    assert default_tiling(5120, 5120, 128, H200).epilogue_n == WIDE_EPILOGUE_N
    assert default_tiling(7680, 5120, WIDE_EPILOGUE_MAX_K, H200).epilogue_n == WIDE_EPILOGUE_N
    assert default_tiling(5120, 5120, 512, H200).epilogue_n == GemmTiling.epilogue_n
    assert default_tiling(5120, 5120, 128, B200).epilogue_n == GemmTiling.epilogue_n


def test_default_tiling_is_valid_for_the_layer_products():
    for m, n, k in ((128, 5120, 5120), (8192, 14336, 5120), (5120, 5120, 8192), (640, 1536, 8192), (8192, 640, 1536)):
        default_tiling(m, n, k, H200).check_sm90()
        default_tiling(m, n, k, B200).check_sm100()


def test_batched_head_products_take_one_head_a_tile():
    """056's P . v and P^T . g_ao: hundreds of [s, 160] products, one 128 x 160 tile across N
    (the single product of the same shape keeps the many-small-tiles rule)."""
    assert default_tiling(449, 160, 449, H200, batches=512) == GemmTiling(tile_m=128, tile_n=160, cluster_m=2)
    assert default_tiling(128, 160, 128, H200, batches=1024) == GemmTiling(tile_m=128, tile_n=160)
    assert default_tiling(449, 160, 449, H200) == GemmTiling(tile_m=64, tile_n=128)
    for gpu, check in ((H200, "check_sm90"), (B200, "check_sm100")):
        getattr(default_tiling(449, 160, 449, gpu, batches=512), check)()


def test_batched_inverse_rope_at_short_k_takes_64_row_pingpong_tiles():
    """056's dq (one head a tile, K = s <= 1024) on sm_90a: 64-row pingpong tiles in 2 x 1
    clusters; dk's sum over four heads (K = 4 s) past 1024 and sm_100a keep 128-row tiles."""
    assert default_tiling(449, 160, 449, H200, fused=0, group_n=160, batches=512) == \
        GemmTiling(tile_m=64, tile_n=160, cluster_m=2, pingpong=True)
    assert default_tiling(449, 160, 4 * 512, H200, group_n=160, batches=128).tile_m == 128
    assert not default_tiling(449, 160, 449, B200, group_n=160, batches=512).pingpong
    default_tiling(449, 160, 449, H200, group_n=160, batches=512).check_sm90()


def test_batch_sums_of_few_tiles_take_64_row_pingpong_tiles():
    """056's dv summed over four heads: 64-row pingpong tiles where 128-row ones would fill at
    most half the SMs (613 x 1: 8 sums of 5 tiles), 128 rows from there (691 x 2: 16 x 6)."""
    assert default_tiling(613, 160, 4 * 640, H200, batches=8, summed=4).spec == "64x160c2x1p"
    assert default_tiling(691, 160, 4 * 704, H200, batches=16, summed=4).tile_m == 128
    assert default_tiling(613, 160, 640, H200, batches=8).tile_m == 128  # the same products, not summed


def test_few_column_group_tiles_split_k():
    """One product of few tiles a column group wide and long K (056's g_ao at <= 256 tokens:
    32 / 64 tiles of 128 x 160) deals its k-iterations out over every SM."""
    from cutebwd.layouts.gemm import even_clusters

    assert default_tiling(128, 5120, 5120, H200, fused=1, group_n=160) == \
        GemmTiling(tile_m=128, tile_n=160, split_k=True)
    assert even_clusters(default_tiling(256, 5120, 5120, H200, fused=1, group_n=160), 256, 5120).spec == "128x160c2x1s"
    assert not default_tiling(422, 5120, 5120, H200, fused=1, group_n=160).split_k  # 128 tiles: one a CTA
    assert not default_tiling(128, 5120, 512, H200, fused=1, group_n=160).split_k  # short K
    assert not default_tiling(128, 160, 5120, H200, group_n=160, batches=32).split_k  # a batch fills the SMs itself


def test_short_k_fused_products_load_more_epilogue_inputs_ahead():
    """056's softmax_bwd (K = head_dim) is epilogue-bound on sm_90a: eight input slots; the
    dSwiGLU product (K = hidden) keeps two, for its main loop's stages."""
    assert default_tiling(449, 449, 160, H200, fused=1, batches=512).epilogue_input_stages == 8
    assert default_tiling(8192, 14336, 5120, H200, fused=3).epilogue_input_stages == 2
    assert default_tiling(300, 520, 200, H200, fused=3).epilogue_input_stages == 2  # three inputs' slots: no room
    default_tiling(449, 449, 160, H200, fused=1, batches=512).check_sm90()


def test_odd_tile_rows_turn_the_cluster_along_n():
    """A 2 x 1 cluster over an odd count of tile rows would idle one CTA of its last cluster row:
    the cluster turns to 1 x 2 where N's tiles pair up, else goes; even counts, sm_100a's 2-CTA
    pairs and tilings asked for by name keep theirs."""
    from cutebwd.kernels.gemm.epilogue import STORE
    from cutebwd.kernels.gemm.dispatch import choose_tiling

    wide = GemmTiling(tile_m=128, tile_n=256, cluster_m=2)
    assert even_clusters(wide, 613, 14336) == GemmTiling(tile_m=128, tile_n=256, cluster_n=2)
    assert even_clusters(wide, 422, 14336) == wide  # four tile rows
    assert even_clusters(wide, 613, 14336, "sm_100a") == wide
    assert even_clusters(GemmTiling(tile_m=64, tile_n=128, cluster_m=2), 100, 5120).cluster_m == 2  # two 64-row tiles
    # 056's P . v at s = 293: three tile rows, one 160-column tile: no cluster
    assert choose_tiling(None, 293, 160, 293, H200, STORE, None, batches=8) == GemmTiling(tile_m=128, tile_n=160)
    assert choose_tiling(wide, 613, 14336, 5120, H200, STORE, None) == wide
    for tiling in (even_clusters(wide, 613, 14336),
                   even_clusters(default_tiling(1382, 14336, 5120, H200), 1382, 14336)):
        tiling.check_sm90()


@pytest.mark.parametrize("a,b,error", [
    (torch.zeros(8, 64), torch.zeros(8, 64, dtype=torch.bfloat16), TypeError),  # a is fp32
    (torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16), ValueError),  # on the CPU
])
def test_argument_errors_name_the_argument(a, b, error):
    from cutebwd.kernels.gemm import matmul_nt

    with pytest.raises(error, match="^a: "):
        matmul_nt(a, b)


def _reference(a, b):
    return (a.float() @ b.float().t())


@pytest.mark.gpu
@pytest.mark.parametrize("a_view,b_view", [("k", "n"), ("m", "n"), ("k", "k")])
@pytest.mark.parametrize("m,n,k", [(128, 128, 64), (296, 520, 64), (1000, 776, 1000), (2048, 5120, 512)])
@pytest.mark.parametrize("variant", ["default", "cluster 2x1", "pingpong", "pingpong, cluster 2x1", "256x160",
                                     "cluster 1x2", "pingpong, cluster 1x2", "wide pieces, pingpong",
                                     "wide pieces 64"])
def test_matches_an_fp32_matmul(a_view, b_view, m, n, k, variant):
    """Sizes that are not tile multiples (TMA bounds), K = 64 (one k-tile), both operand
    majors, cooperative and pingpong consumers, 256-row tiles (two 64-row blocks a warpgroup);
    extents stay multiples of 8 because TMA needs 16-byte strides."""
    from cutebwd.kernels.gemm import matmul_nt

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16() if a_view == "k" else \
        torch.randn(k, m, device="cuda", generator=g).bfloat16().t()
    b = torch.randn(n, k, device="cuda", generator=g).bfloat16() if b_view == "k" else \
        torch.randn(k, n, device="cuda", generator=g).bfloat16().t()
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    rules = default_tiling(m, n, k, H200)  # the H200 suite runs these
    tiling = {"default": rules, "cluster 2x1": dataclasses.replace(rules, cluster_m=2),
              "pingpong": GemmTiling(pingpong=True), "pingpong, cluster 2x1": GemmTiling(pingpong=True, cluster_m=2),
              "256x160": GemmTiling(tile_m=256, tile_n=160), "cluster 1x2": GemmTiling(tile_n=256, cluster_n=2),
              "pingpong, cluster 1x2": GemmTiling(pingpong=True, cluster_n=2),
              "wide pieces, pingpong": GemmTiling(pingpong=True, cluster_m=2, epilogue_n=128),
              "wide pieces 64": GemmTiling(epilogue_n=64)}[variant]
    matmul_nt(a, b, out=out, tiling=tiling)
    ref = _reference(a, b)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 1e-2


def _operands(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(m, k, device="cuda", generator=g).bfloat16(),
            torch.randn(n, k, device="cuda", generator=g).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(200, 136, 64), (1024, 512, 3000)])
def test_fp32_output(m, n, k):
    from cutebwd.kernels.gemm import matmul_nt

    a, b = _operands(m, n, k)
    out = torch.full((m, n), float("nan"), device="cuda")
    matmul_nt(a, b, out=out)
    ref = _reference(a, b)
    assert relative_error(out, ref) < 1e-5
    assert matmul_nt(a, b, out_dtype=torch.float32).dtype == torch.float32


@pytest.mark.gpu
def test_errors_on_the_gpu():
    from cutebwd.kernels.gemm import matmul_nt

    a, b = _operands(64, 64, 64)
    with pytest.raises(ValueError, match="K extents"):
        matmul_nt(a, b[:, :56])
    with pytest.raises(ValueError, match="^a: .*multiple of 8"):
        matmul_nt(torch.randn(64, 65, device="cuda").bfloat16()[:, :64], b)
    matmul_nt(a, b)  # now cached: the same shape with a bad argument must still be explained
    with pytest.raises(TypeError, match="^out"):
        matmul_nt(a, b, out=torch.empty(64, 64, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="^out"):
        matmul_nt(a, b, out=torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)[:, ::2])


@pytest.mark.gpu
def test_empty_and_zero_k():
    from cutebwd.kernels.gemm import matmul_nt

    a, b = _operands(64, 32, 0)
    assert (matmul_nt(a, b) == 0).all()
    assert matmul_nt(*_operands(0, 32, 64)).shape == (0, 32)


@pytest.mark.parametrize("tiles,k_tiles,ctas", [(80, 80, 132), (320, 80, 132), (1280, 80, 132), (20, 80, 132),
                                                (7, 3, 4), (133, 10, 132), (264, 5, 132), (1, 1, 132)])
def test_stream_k_schedule_covers_every_k_iteration_once(tiles, k_tiles, ctas):
    """The hybrid schedule the kernel walks: every (tile, k-tile) exactly once, a tile's
    partials come from the CTAs just below its finisher, and each CTA hands on at most one."""
    from cutebwd.layouts.gemm import cta_work, stream_k_plan

    dp_tiles, per = stream_k_plan(tiles, k_tiles, ctas, min_iterations=1)
    owner = {}
    for cta in range(ctas):
        units = cta_work(cta, ctas, tiles, k_tiles, dp_tiles, per)
        assert sum(k_end < k_tiles for _, _, k_end in units) <= 1
        for tile, k_begin, k_end in units:
            assert 0 <= k_begin < k_end <= k_tiles
            for k in range(k_begin, k_end):
                assert (tile, k) not in owner
                owner[tile, k] = cta
    assert len(owner) == tiles * k_tiles
    for tile in range(dp_tiles, tiles):
        ctas_of_tile = sorted({owner[tile, k] for k in range(k_tiles)})
        assert ctas_of_tile == list(range(ctas_of_tile[0], ctas_of_tile[-1] + 1))
        assert ctas_of_tile[0] == (tile - dp_tiles) * k_tiles // per


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m,tile_n,cluster,pingpong", [
    (128, 128, (1, 1), False), (128, 256, (1, 1), False), (128, 256, (2, 1), False), (128, 128, (1, 2), False),
    (128, 128, (1, 1), True), (64, 256, (2, 1), True), (256, 160, (1, 1), False)])
@pytest.mark.parametrize("m,n,k", [(512, 5120, 1024), (128, 1280, 4096), (1000, 776, 1000), (2048, 640, 512)])
def test_stream_k_matches_and_repeats_bitwise(m, n, k, tile_m, tile_n, cluster, pingpong):
    """Stream-K forced on (ragged last waves cut into k-iterations), with and without clusters
    (multicast loads; odd tile counts leave a CTA of a cluster past the edge): right against
    fp32, and the same bits call to call."""
    from cutebwd.kernels.gemm import matmul_nt
    from cutebwd.layouts.gemm import GemmTiling

    a, b = _operands(m, n, k, seed=m + n)
    tiling = GemmTiling(tile_m=tile_m, tile_n=tile_n, cluster_m=cluster[0], cluster_n=cluster[1], pingpong=pingpong)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    matmul_nt(a, b, out=out, tiling=tiling, stream_k=True)
    ref = _reference(a, b)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 1e-2
    for _ in range(4):
        assert torch.equal(matmul_nt(a, b, tiling=tiling, stream_k=True), out)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,tiling", [(128, 1280, 4096, GemmTiling(tile_n=256, split_k=True)),
                                          (200, 5120, 5120, GemmTiling(tile_n=256, cluster_m=2, split_k=True)),
                                          (128, 640, 1536, GemmTiling(pingpong=True, split_k=True))])
def test_split_k_spreads_few_tiles_over_every_sm(m, n, k, tiling):
    """Fewer tiles than SMs, their k-iterations dealt out over every SM: right against fp32,
    the same bits call to call, and the same kernel as without split_k (one compile)."""
    from cutebwd.kernels.gemm import dispatch as gemm

    a, b = _operands(m, n, k, seed=k)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    compiled = len(gemm._compiled)
    gemm.matmul_nt(a, b, out=out, tiling=dataclasses.replace(tiling, split_k=False))
    gemm.matmul_nt(a, b, out=out, tiling=tiling)
    assert len(gemm._compiled) <= compiled + 1
    ref = _reference(a, b)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 1e-2
    for _ in range(4):
        assert torch.equal(gemm.matmul_nt(a, b, tiling=tiling), out)


@pytest.mark.gpu
def test_stream_k_under_graph_replay_and_side_streams():
    from cutebwd.kernels.gemm import matmul_nt

    a, b = _operands(512, 5120, 1024, seed=3)
    want = matmul_nt(a, b, stream_k=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got_side = matmul_nt(a, b, stream_k=True)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got_side, want)
    out = torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul_nt(a, b, out=out, stream_k=True)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("stream_k,tile_n", [(None, 96), (True, 224)])
def test_first_call_of_a_shape_inside_graph_capture(stream_k, tile_n):
    """A shape and a tiling (2 x 1 clusters, used by no other test) met for the first time under
    CUDA-graph capture, as torch.compile's CUDA graphs do: compile, cluster query and, with
    stream-K units, the workspace all inside it."""
    from cutebwd.kernels.gemm import dispatch as gemm

    m, n, k = (1064, 1288, 328) if stream_k is None else (2100, 1800, 2504)
    a, b = _operands(m, n, k, seed=11)
    tiling = GemmTiling(tile_m=128, tile_n=tile_n, cluster_m=2)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm.matmul_nt(a, b, out=out, tiling=tiling, stream_k=stream_k)
    assert bool(gemm._calls[m, n, k, True, True, "bfloat16", a.get_device(), tiling, stream_k, "store"].per) == bool(stream_k)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference(a, b)
    assert relative_error(out, ref) < 1e-2


def test_calls_without_stream_k_pass_one_fixed_workspace():
    """A shape with no stream-K units hands the kernel one stand-in workspace (never read) with
    no per-stream lookup; one with stream-K units keeps its per-stream workspace. The kernel
    launch is replaced by a recorder: this is the host path alone, on the CPU."""
    from cutebwd.kernels.gemm import dispatch as gemm

    seen = []
    cpu = torch.device("cpu")
    whole_waves = gemm.Call(lambda *args: seen.append(args), 64, GemmTiling(), 1024, 1024, 512, cpu, None,
                             torch.bfloat16)
    assert whole_waves.per == 0 and whole_waves.fixed_args[2:] == (64, 64, 0)
    ragged = gemm.Call(None, 10, GemmTiling(), 1000, 776, 4000, cpu, None, torch.bfloat16)
    assert ragged.per and ragged.fixed_args is None
    a, b = torch.zeros(1024, 512, dtype=torch.bfloat16), torch.zeros(1024, 512, dtype=torch.bfloat16)
    key = (1024, 1024, 512, True, True, "bfloat16", a.get_device(), None, None, "store")
    gemm._calls[key] = whole_waves
    try:
        for _ in range(2):
            out = gemm.matmul_nt(a, b)
            assert out.dtype == torch.bfloat16 and out.shape == (1024, 1024)
    finally:
        del gemm._calls[key]
    partials, flags, *schedule = whole_waves.fixed_args
    assert len(seen) == 2
    assert all(args[3] is partials and args[4] is flags and list(args[5:8]) == schedule and args[8:] == gemm.NO_EPILOGUE_TENSORS
               for args in seen)


def test_run_call_zero_k_and_rejected_calls():
    """The launch step matmul_nt and matmul_nt_batched share, on the CPU with a stand-in call:
    K = 0 writes the epilogue of a zero accumulator and launches nothing; a launch the C-side
    checks reject is explained, then its error goes on."""
    import types

    from cutebwd.kernels.gemm import dispatch as gemm

    launches, explained = [], []
    call = types.SimpleNamespace(run=lambda *args: launches.append(args), fixed_args=(None,) * 5)
    out = torch.ones(4, 6)
    gemm.run_call(call, torch.zeros(4, 0), torch.zeros(6, 0), out, "store", (), None, None, 1.0,
                  lambda: explained.append(1))
    assert not launches and not explained and bool((out == 0).all())

    def rejected(*args):
        raise TypeError("rejected in C")
    call.run = rejected
    with pytest.raises(TypeError, match="rejected in C"):
        gemm.run_call(call, torch.zeros(4, 8), torch.zeros(6, 8), out, "store", (), None, None, 1.0,
                      lambda: explained.append(1))
    assert explained == [1]


def test_stream_k_stays_off_on_short_k_unless_forced():
    """Ragged waves go stream-K from MIN_K_TILES k-tiles up (below, the partial-tile hand-over
    costs more than the balance gains); stream_k=True still forces it."""
    from cutebwd.kernels.gemm import dispatch as gemm

    cpu, tiling = torch.device("cpu"), GemmTiling()
    for k_tiles, forced, stream_k in ((gemm.MIN_K_TILES - 1, None, False), (gemm.MIN_K_TILES, None, True),
                                      (8, True, True), (80, False, False)):
        call = gemm.Call(None, 66, tiling, 2048, 1280 + 128, k_tiles * tiling.tile_k, cpu, forced, torch.bfloat16)
        assert bool(call.per) == stream_k, (k_tiles, forced)


def test_sm100_tiling_checks():
    for tiling in (GemmTiling(), GemmTiling(tile_n=256, cluster_m=2), GemmTiling(tile_m=64, tile_n=128)):
        tiling.check_sm100()
    for bad in (GemmTiling(tile_m=256), GemmTiling(tile_n=48), GemmTiling(tile_k=32), GemmTiling(cluster_m=16),
                GemmTiling(pingpong=True)):
        with pytest.raises(ValueError):
            bad.check_sm100()
    assert GemmTiling(cluster_m=2).two_cta_mma and not GemmTiling(tile_m=64, cluster_m=2).two_cta_mma
    assert not GemmTiling().two_cta_mma


def _bar_tilings(gpu):
    """Every (tiling, A K-major?, B K-major?) the default rules pick on `gpu` for the benchmarked
    products (tools/bench_gemm)."""
    from cutebwd.tools.bench_gemm import TOKENS, WIDTHS

    picked = set()
    for t in TOKENS:
        for out_features, in_features in WIDTHS:
            picked.add((default_tiling(t, in_features, out_features, gpu), True, False))  # dX = dY . W
            picked.add((default_tiling(out_features, in_features, t, gpu), False, False))  # dW = dY^T . X
    return [(gpu.arch, *case) for case in sorted(picked, key=str)]


@pytest.mark.parametrize("arch,tiling,a_k_major,b_k_major", _bar_tilings(H200) + _bar_tilings(B200), ids=str)
def test_every_tiling_the_rules_pick_compiles_and_passes_the_audit(arch, tiling, a_k_major, b_k_major):
    """What the dispatch would run on each arch compiles, holds the instructions its main loop
    declares (sm_90a: pipelined warpgroup MMAs; sm_100a: tcgen05 MMAs and tensor-memory loads)
    and fits the hardware (registers, shared and tensor memory, cluster). No Blackwell GPU is
    here, so for sm_100a this is all the evidence there is."""
    from cutebwd.kernels.gemm import dispatch as gemm
    from cutebwd.tools import audit

    module = gemm.MAIN_LOOPS[arch]
    result = audit.audit_build(lambda arch, dump_dir: module.build(tiling, a_k_major, b_k_major, "bfloat16", arch,
                                                                   dump_dir), arch, audit.find_nvdisasm())
    result.update(kernel=str(tiling), arch=arch)
    assert not audit.build_problems(result, module.AUDIT_EXPECTS)


def test_one_host_wrapper_for_both_arches():
    """The sm_90a and sm_100a kernels take the same arguments from the same host code: the
    per-arch modules only build kernels (gemm.MAIN_LOOPS), they hold no host wrapper."""
    import inspect

    from cutebwd.kernels.gemm import MAIN_LOOPS, sm90 as gemm_sm90, sm100 as gemm_sm100

    assert set(MAIN_LOOPS) == {"sm_90a", "sm_100a", "sm_103a"}
    assert inspect.signature(gemm_sm90.build).parameters.keys() == inspect.signature(gemm_sm100.build).parameters.keys()
    for module in (gemm_sm90, gemm_sm100):
        assert not hasattr(module, "matmul_nt") and not hasattr(module, "Call")


def test_blackwell_pairs_run_two_cta_mmas():
    """A 2 x 1 cluster of 128-row tiles is one 256-row MMA tile: 2-CTA tcgen05 MMAs and TMA
    loads in the machine code; a lone CTA's build has neither."""
    from cutebwd.kernels.gemm import sm100 as gemm_sm100
    from cutebwd.tools import audit

    nvdisasm = audit.find_nvdisasm()
    pair = audit.audit_build(lambda arch, dump_dir: gemm_sm100.build(
        GemmTiling(tile_n=256, cluster_m=2), True, False, "bfloat16", arch, dump_dir), "sm_100a", nvdisasm)
    alone = audit.audit_build(lambda arch, dump_dir: gemm_sm100.build(
        GemmTiling(), True, False, "bfloat16", arch, dump_dir), "sm_100a", nvdisasm)
    assert pair["opcodes"].get("UTCHMMA.2CTA") and pair["opcodes"].get("UTMALDG.2D.2CTA")
    assert not any("2CTA" in op for op in alone["opcodes"])
