"""Fused GEMM epilogues (kernels/gemm/epilogue.py): argument errors on any machine; on the
GPU, every epilogue against fp32 PyTorch (autograd for dSwiGLU) on sizes that are not tile
multiples, with outputs poisoned before the call."""
import pytest
import torch

from cutebwd.kernels.gemm.epilogue import ADD, DSWIGLU, ROPE_INVERSE, ROW_DOT, SOFTMAX_BWD, check_epilogue_tensors
from cutebwd.kernels.gemm import matmul_nt
from cutebwd.layouts.gemm import GemmTiling
from cutebwd.tools.parity import relative_error


def test_unknown_epilogue_and_add_without_out_are_errors():
    a = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="epilogue: one of"):
        matmul_nt(a, a, epilogue="relu")
    with pytest.raises(ValueError, match="^out: the 'add' epilogue"):
        matmul_nt(a, a, epilogue="add")


_BF16 = torch.zeros(4, 6, dtype=torch.bfloat16)
_COS = torch.zeros(4, 64, dtype=torch.bfloat16)  # rope_inverse's tables: [M, d]


@pytest.mark.parametrize("epilogue,inputs,out2,rows,n,error,message", [
    (DSWIGLU, (_BF16, _BF16), _BF16, None, 6, ValueError, "reads 3 inputs"),
    (DSWIGLU, (_BF16.float(), _BF16, _BF16), _BF16, None, 6, TypeError, "^gate: expected dtype bfloat16"),
    (DSWIGLU, (_BF16, _BF16, None), None, None, 6, ValueError, "^silu_up: the 'dswiglu' epilogue needs it"),
    (ADD, (_BF16,), None, None, 6, ValueError, "^c: expected a CUDA tensor"),
    (ADD, (_BF16,), None, torch.zeros(4), 6, ValueError, "^rows: the 'add' epilogue has no per-row tensor"),
    (ROW_DOT, (_BF16,), None, None, 6, ValueError, "^rows: the 'row_dot' epilogue writes its fp32 row sums there"),
    (ROW_DOT, (_BF16,), None, torch.zeros(4, 2, dtype=torch.bfloat16), 6, TypeError, "^rows: expected dtype float32"),
    (SOFTMAX_BWD, (_BF16,), None, None, 6, ValueError, "^rows: the 'softmax_bwd' epilogue reads its fp32 row values"),
    (ROPE_INVERSE, (_COS,), None, None, 128, ValueError, "reads 2 inputs"),
    (ROPE_INVERSE, (_COS.float(), _COS), None, None, 128, TypeError, "^cos: expected dtype bfloat16"),
], ids=lambda v: v.name if hasattr(v, "inputs") else None)
def test_epilogue_tensor_errors_name_the_tensor(epilogue, inputs, out2, rows, n, error, message):
    with pytest.raises(error, match=message):
        check_epilogue_tensors(epilogue, inputs, out2, 4, n, torch.device("cpu"), rows)


@pytest.mark.gpu
def test_epilogue_tensor_shapes_and_strides_are_checked():
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    dev = torch.device("cuda", torch.cuda.current_device())
    ok = torch.zeros(4, 8, **bf16)
    with pytest.raises(ValueError, match="^grad_up: expected shape"):
        check_epilogue_tensors(DSWIGLU, (ok, ok, ok), torch.zeros(4, 7, **bf16), 4, 8, dev)
    with pytest.raises(ValueError, match="^up: expected row-major"):
        check_epilogue_tensors(DSWIGLU, (ok, torch.zeros(8, 4, **bf16).t(), ok), ok, 4, 8, dev)
    with pytest.raises(ValueError, match="^gate: expected row-major with a 16-byte multiple row stride"):
        check_epilogue_tensors(DSWIGLU, (torch.zeros(4, 12, **bf16)[:, :8], ok, ok), ok, 4, 8, dev)
    with pytest.raises(ValueError, match="^gate: data pointer must be 16-byte aligned"):
        check_epilogue_tensors(DSWIGLU, (torch.zeros(4, 24, **bf16)[:, 1:9], ok, ok), ok, 4, 8, dev)
    wide = torch.zeros(4, 24, **bf16)[:, 8:16]  # a wider row stride is fine (TMA reads it)
    check_epilogue_tensors(DSWIGLU, (wide, wide, wide), ok, 4, 8, dev)


def _operands(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(m, k, device="cuda", generator=g).bfloat16(),
            torch.randn(n, k, device="cuda", generator=g).bfloat16().t().contiguous().t(), g)


def _close(got, want, bound=1e-2):
    return relative_error(got, want) < bound


TILINGS = [None, GemmTiling(tile_n=256, cluster_m=2), GemmTiling(pingpong=True, cluster_m=2),
           GemmTiling(tile_m=256, tile_n=160), GemmTiling(tile_m=64, tile_n=128, cluster_m=2),
           GemmTiling(tile_n=256, cluster_n=2)]


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: t.spec if t else "default")
@pytest.mark.parametrize("m,n,k,stream_k", [(300, 520, 200, None), (1000, 776, 2600, True), (128, 5120, 512, None)])
def test_add_epilogue_adds_into_out(m, n, k, stream_k, tiling):
    a, b, g = _operands(m, n, k, seed=m + n)
    c = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    want = c.float() + a.float() @ b.float().t()
    got = matmul_nt(a, b, out=c, epilogue="add", tiling=tiling, stream_k=stream_k)
    assert got is c and _close(c, want)
    with pytest.raises(ValueError, match="^out: the 'add' epilogue"):  # the shape's call is cached now
        matmul_nt(a, b, epilogue="add", tiling=tiling, stream_k=stream_k)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: t.spec if t else "default")
@pytest.mark.parametrize("m,n,k,stream_k", [(300, 520, 200, None), (1000, 776, 2600, True), (211, 14336, 5120, None)])
def test_dswiglu_epilogue_matches_autograd(m, n, k, stream_k, tiling):
    """056's down-projection product g_sw = go . Wd with g_gate and g_up made from its
    accumulator (silu on `up`): g_up against autograd of gate * silu(up) in fp32, g_gate =
    g_sw * silu_up with silu_up an independent draw (read, not recomputed from up)."""
    go, wd_t, g = _operands(m, n, k, seed=m * 3 + n)  # wd_t: Wd [k, n] read as [n, k], N-major
    gate, silu_up = (torch.randn(m, n, device="cuda", generator=g).bfloat16() for _ in range(2))
    up = (2 * torch.randn(m, n, device="cuda", generator=g)).bfloat16()
    g_sw = go.float() @ wd_t.float().t()
    gate32, up32 = gate.float().requires_grad_(), up.float().requires_grad_()
    (gate32 * torch.nn.functional.silu(up32)).backward(g_sw)
    grad_gate = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grad_up = torch.full_like(grad_gate, float("nan"))
    got = matmul_nt(go, wd_t, out=grad_gate, out2=grad_up, epilogue="dswiglu", inputs=(gate, up, silu_up),
                    tiling=tiling, stream_k=stream_k)
    assert got[0] is grad_gate and got[1] is grad_up
    assert _close(grad_gate, g_sw * silu_up.float()) and _close(grad_up, up32.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [None, GemmTiling(pingpong=True, cluster_m=2)], ids=lambda t: t.spec if t else "default")
@pytest.mark.parametrize("m,n,k,stream_k", [(300, 520, 200, None), (2048, 2048, 640, None), (1000, 776, 2600, True)])
def test_dgeglu_epilogue_matches_autograd(m, n, k, stream_k, tiling):
    """Gemma's down-projection product g_h = g_y . Wd with g_gate and g_up made from its
    accumulator: against autograd of gelu_tanh(gate) * up in fp32."""
    go, wd_t, g = _operands(m, n, k, seed=m * 5 + n)
    gate, up = ((3 * torch.randn(m, n, device="cuda", generator=g)).bfloat16() for _ in range(2))
    g_h = go.float() @ wd_t.float().t()
    gate32, up32 = gate.float().requires_grad_(), up.float().requires_grad_()
    (torch.nn.functional.gelu(gate32, approximate="tanh") * up32).backward(g_h)
    got = matmul_nt(go, wd_t, epilogue="dgeglu", inputs=(gate, up), tiling=tiling, stream_k=stream_k)
    assert _close(got[0], gate32.grad) and _close(got[1], up32.grad)


@pytest.mark.gpu
def test_dswiglu_allocates_its_outputs_and_repeats_bitwise():
    go, wd_t, g = _operands(256, 640, 320, seed=5)
    gate, up, silu_up = (torch.randn(256, 640, device="cuda", generator=g).bfloat16() for _ in range(3))
    first = matmul_nt(go, wd_t, epilogue="dswiglu", inputs=(gate, up, silu_up))
    again = matmul_nt(go, wd_t, epilogue="dswiglu", inputs=(gate, up, silu_up))
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    plain = matmul_nt(go, wd_t)  # same shape, plain build: a separate cache entry
    assert _close(first[0], plain.float() * silu_up.float())


def test_alpha_is_only_softmax_bwds():
    a = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^alpha: only the 'softmax_bwd' epilogue scales"):
        matmul_nt(a, a, epilogue="row_dot", inputs=(a,), alpha=0.5)


@pytest.mark.gpu
def test_per_row_tensor_shapes_and_strides_are_checked():
    x = torch.zeros(4, 8, dtype=torch.bfloat16, device="cuda")
    dev = x.device
    with pytest.raises(ValueError, match=r"^rows: fp32 \[M, groups\] row sums with N = 8 a whole number"):
        check_epilogue_tensors(ROW_DOT, (x,), None, 4, 8, dev, torch.zeros(4, 3, device="cuda"))
    with pytest.raises(ValueError, match=r"^rows: fp32 \[M, groups\]"):
        check_epilogue_tensors(ROW_DOT, (x,), None, 4, 8, dev, torch.zeros(3, 2, device="cuda"))
    with pytest.raises(ValueError, match="^rows: unit column stride"):
        check_epilogue_tensors(ROW_DOT, (x,), None, 4, 8, dev, torch.zeros(2, 4, device="cuda").t())
    check_epilogue_tensors(ROW_DOT, (x,), None, 4, 8, dev, torch.zeros(4, 2, device="cuda"))
    with pytest.raises(ValueError, match=r"^rows: fp32 \[M = 4\] row values"):
        check_epilogue_tensors(SOFTMAX_BWD, (x,), None, 4, 8, dev, torch.zeros(10, device="cuda")[::2])
    check_epilogue_tensors(SOFTMAX_BWD, (x,), None, 4, 8, dev, torch.zeros(8, device="cuda")[::2])  # any stride
    with pytest.raises(ValueError, match="^rows: expected 1 dimensions"):
        check_epilogue_tensors(SOFTMAX_BWD, (x,), None, 4, 8, dev, torch.zeros(4, 1, device="cuda"))
    check_epilogue_tensors(SOFTMAX_BWD, (x,), None, 4, 8, dev, torch.zeros(4, device="cuda"))


def _row_dot_case(m, heads, k, seed, head_dim=160):
    """056's g_ao = g_attn . Wo ([T, H] . [H, heads * d]) with D = rowsum(g_ao * x) per head:
    operands, x, the fp32 product and the row sums' reference as a function of the stored C
    (row_dot sums C as stored in bf16; a fp32 product rounded by us can differ from the
    kernel's in the last place, its accumulation order being another)."""
    n = heads * head_dim
    g_attn, wo_t, g = _operands(m, n, k, seed)
    x = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    g_ao = g_attn.float() @ wo_t.float().t()
    return g_attn, wo_t, x, g_ao, lambda stored: (stored.float() * x.float()).view(m, heads, head_dim).sum(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [None, GemmTiling(tile_n=160), GemmTiling(tile_m=256, tile_n=160),
                                    GemmTiling(tile_n=160, cluster_n=2)],
                         ids=lambda t: t.spec if t else "default")
@pytest.mark.parametrize("m,heads,k,stream_k", [(300, 3, 200, None), (1000, 5, 2600, True), (128, 32, 512, None),
                                                (77, 1, 5120, None)])
def test_row_dot_epilogue_sums_each_head(m, heads, k, stream_k, tiling):
    g_attn, wo_t, attn_output, want, want_sums = _row_dot_case(m, heads, k, seed=m + heads)
    out = torch.full((m, heads * 160), float("nan"), dtype=torch.bfloat16, device="cuda")
    sums = torch.full((m, heads), float("nan"), device="cuda")
    got = matmul_nt(g_attn, wo_t, out=out, rows=sums, epilogue="row_dot", inputs=(attn_output,), tiling=tiling,
                    stream_k=stream_k)
    assert got[0] is out and got[1] is sums
    assert _close(out, want) and _close(sums, want_sums(out), 1e-4)


@pytest.mark.gpu
def test_row_dot_groups_pick_the_tile_width_and_repeat_bitwise():
    g_attn, w_t, x, want, _ = _row_dot_case(256, 4, 320, seed=9, head_dim=128)
    for groups in (4, 2):  # 128- then 256-column groups: same shape, two cache entries
        sums = torch.full((256, groups), float("nan"), device="cuda")
        first = matmul_nt(g_attn, w_t, rows=sums, epilogue="row_dot", inputs=(x,))[1].clone()
        stored, _ = matmul_nt(g_attn, w_t, rows=sums, epilogue="row_dot", inputs=(x,))
        assert torch.equal(first, sums)
        assert _close(stored, want)
        assert _close(sums, (stored.float() * x.float()).view(256, groups, -1).sum(-1), 1e-4)
    with pytest.raises(ValueError, match="tile_n must be the column group"):
        matmul_nt(g_attn, w_t, rows=torch.empty(256, 4, device="cuda"), epilogue="row_dot", inputs=(x,),
                  tiling=GemmTiling(tile_n=256))
    with pytest.raises(ValueError, match="^rows: the 'row_dot' epilogue writes"):
        matmul_nt(g_attn, w_t, epilogue="row_dot", inputs=(x,))


def _softmax_backward_case(s, head_dim, seed):
    """One head of 056's attention backward: g_p = g_ao . v^T ([s, d] . [d, s]) and
    g_s = P * (g_p - D) / sqrt(d), D = rowsum(P * g_p), with P a softmax of random scores."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    g_ao = torch.randn(s, head_dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(s, head_dim, device="cuda", generator=g).bfloat16()
    p = torch.softmax(2 * torch.randn(s, s, device="cuda", generator=g), -1).bfloat16()
    g_p = g_ao.float() @ v.float().t()
    d = (p.float() * g_p).sum(-1)
    return g_ao, v, p, d, p.float() * (g_p - d[:, None]) * head_dim**-0.5


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [None, GemmTiling(tile_n=256, cluster_m=2), GemmTiling(tile_m=64, tile_n=128)],
                         ids=lambda t: t.spec if t else "default")
@pytest.mark.parametrize("s,stream_k", [(296, None), (1024, True), (72, None)])  # TMA: rows of 16-byte multiples
def test_softmax_bwd_epilogue_matches_the_reference(s, stream_k, tiling):
    g_ao, v, p, d, want = _softmax_backward_case(s, 160, seed=s)
    out = torch.full((s, s), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = matmul_nt(g_ao, v, out=out, epilogue="softmax_bwd", inputs=(p,), rows=d, alpha=160**-0.5, tiling=tiling,
                    stream_k=stream_k)
    assert got is out and _close(out, want)
    again = matmul_nt(g_ao, v, epilogue="softmax_bwd", inputs=(p,), rows=d, alpha=160**-0.5, tiling=tiling,
                      stream_k=stream_k)
    assert torch.equal(again, out)
    half = matmul_nt(g_ao, v, epilogue="softmax_bwd", inputs=(p,), rows=d, alpha=0.5 * 160**-0.5, tiling=tiling,
                     stream_k=stream_k)  # another alpha: another build, not the cached one
    assert _close(half, 0.5 * want)


@pytest.mark.gpu
def test_softmax_bwd_with_d_from_row_dot_and_empty_k():
    """D as 056 gets it: rowsum(g_ao * P v) from the row_dot epilogue of the product
    that makes g_ao (here one head, its output O = P . v)."""
    g_ao, v, p, d, want = _softmax_backward_case(256, 160, seed=3)
    o = (p.float() @ v.float()).bfloat16()
    eye = torch.eye(160, device="cuda", dtype=torch.bfloat16)
    _, d_rows = matmul_nt(g_ao, eye, epilogue="row_dot", inputs=(o,), rows=torch.empty(256, 1, device="cuda"))
    assert _close(d_rows[:, 0], d, 2e-2)
    got = matmul_nt(g_ao, v, epilogue="softmax_bwd", inputs=(p,), rows=d_rows[:, 0].contiguous(), alpha=160**-0.5)
    assert _close(got, want, 2e-2)
    empty = torch.zeros(256, 0, dtype=torch.bfloat16, device="cuda")
    got = matmul_nt(empty, empty[:160], epilogue="softmax_bwd", inputs=(p[:, :160].contiguous(),), rows=d, alpha=2.0)
    assert _close(got, p[:, :160].float() * -d[:, None] * 2.0)


def _rope_tables(m, d, seed, device="cuda"):
    """Standard RoPE cos and sin [m, d] (equal halves) for positions 0..m-1, rounded to bf16."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    angles = torch.arange(m, device=device).float()[:, None] * inv_freq[None, :] + seed
    angles = torch.cat([angles, angles], -1)
    return angles.cos().bfloat16(), angles.sin().bfloat16()


def _rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat([-t[..., half:], t[..., :half]], -1)


@pytest.mark.gpu
def test_rope_table_shapes_are_checked():
    cos = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    dev = cos.device
    with pytest.raises(ValueError, match=r"^cos and sin: \[M, d\] tables of one shape, d a multiple of 32 dividing"):
        check_epilogue_tensors(ROPE_INVERSE, (cos, cos), None, 4, 96, dev)  # 64 does not divide 96
    with pytest.raises(ValueError, match=r"^cos and sin: \[M, d\] tables of one shape"):
        check_epilogue_tensors(ROPE_INVERSE, (cos, cos[:, :32]), None, 4, 128, dev)
    with pytest.raises(ValueError, match="^sin: expected row-major"):
        check_epilogue_tensors(ROPE_INVERSE, (cos, torch.zeros(64, 4, dtype=torch.bfloat16, device="cuda").t()),
                               None, 4, 128, dev)
    check_epilogue_tensors(ROPE_INVERSE, (cos, cos), None, 4, 128, dev)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [None, GemmTiling(tile_n=160), GemmTiling(tile_m=256, tile_n=160)],
                         ids=lambda t: t.spec if t else "default")
@pytest.mark.parametrize("m,heads,k,stream_k", [(211, 1, 216, None), (1000, 3, 2600, True), (128, 4, 512, None)])
def test_rope_inverse_epilogue_matches_the_reference(m, heads, k, stream_k, tiling):
    """056's g_q = g_qr * cos - rotate_half(g_qr) * sin from g_qr = g_s . k_rep ([s, s] . [s, d]:
    B = k_rep^T read N-major in place), heads of d = 160 side by side, cos/sin broadcast."""
    d = 160
    g = torch.Generator(device="cuda").manual_seed(m + heads)
    g_s = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    k_rep = torch.randn(k, heads * d, device="cuda", generator=g).bfloat16()
    cos, sin = _rope_tables(m, d, seed=heads)
    g_qr = (g_s.float() @ k_rep.float()).view(m, heads, d)
    want = (g_qr * cos.float()[:, None] - _rotate_half(g_qr) * sin.float()[:, None]).view(m, heads * d)
    out = torch.full((m, heads * d), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = matmul_nt(g_s, k_rep.t(), out=out, epilogue="rope_inverse", inputs=(cos, sin), tiling=tiling,
                    stream_k=stream_k)
    assert got is out and _close(out, want)
    assert torch.equal(matmul_nt(g_s, k_rep.t(), epilogue="rope_inverse", inputs=(cos, sin), tiling=tiling,
                                 stream_k=stream_k), out)


@pytest.mark.gpu
def test_rope_inverse_heads_of_128_undo_the_rotation():
    """A forward rotation then our inverse gives the product back (d = 128: pingpong tiles)."""
    m, d, k = 256, 128, 192
    a, b, _ = _operands(m, 2 * d, k, seed=11)
    cos, sin = _rope_tables(m, d, seed=0)
    plain = (a.float() @ b.float().t()).view(m, 2, d)
    got = matmul_nt(a, b, epilogue="rope_inverse", inputs=(cos, sin)).float().view(m, 2, d)
    back = got * cos.float()[:, None] + _rotate_half(got) * sin.float()[:, None]
    assert _close(back, plain, 2e-2)  # cos^2 + sin^2 = 1 up to the bf16 tables
    assert not _close(got, plain)  # (it did rotate)
