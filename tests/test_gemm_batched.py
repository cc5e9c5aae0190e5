"""Batched products (kernels/gemm/batched.py): argument errors on any machine; on the GPU,
056's per-(batch, head) products read in place from its [b, s, heads, d] tensors, plain and
with the softmax_bwd and rope_inverse epilogues, against fp32 PyTorch, outputs poisoned."""
import pytest
import torch

from cutebwd.kernels.gemm import matmul_nt_batched
from cutebwd.layouts.gemm import GemmTiling
from cutebwd.tools.parity import relative_error


def test_row_dot_and_add_without_out_are_refused():
    a = torch.zeros(2, 3, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'row_dot' is not batched"):
        matmul_nt_batched(a, a, epilogue="row_dot", inputs=(a,))
    with pytest.raises(ValueError, match="^out: the 'add' epilogue"):
        matmul_nt_batched(a, a, epilogue="add")


def test_group_sum_must_be_a_positive_count():
    a = torch.zeros(2, 4, 8, 64, dtype=torch.bfloat16)
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match="^group_sum: expected a positive int"):
            matmul_nt_batched(a, a, group_sum=bad)


def _heads(b, s, heads, d, generator, scale=1.0):
    """A [b, heads, s, d] view of a [b, s, heads * d] tensor, as 056 holds q, k, v and g_ao."""
    flat = (scale * torch.randn(b, s, heads * d, device="cuda", generator=generator)).bfloat16()
    return flat.view(b, s, heads, d).transpose(1, 2)


def _close(got, want, bound=1e-2):
    return relative_error(got, want) < bound


@pytest.mark.gpu
@pytest.mark.parametrize("tiling,stream_k", [(None, None), (GemmTiling(tile_n=256, cluster_m=2), True),
                                             (GemmTiling(tile_m=64, tile_n=128), None)],
                         ids=["default", "128x256c2x1 stream-K", "64x128"])
@pytest.mark.parametrize("b,heads,s", [(2, 4, 200), (1, 3, 72), (3, 2, 520)])
def test_batched_scores_match_each_head(b, heads, s, tiling, stream_k):
    """g_p = g_ao . v^T per (batch, head), both read through their head-interleaved strides."""
    g = torch.Generator(device="cuda").manual_seed(b * 100 + s)
    g_ao, v = _heads(b, s, heads, 160, g), _heads(b, s, heads, 160, g)
    out = torch.full((b, heads, s, s), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = matmul_nt_batched(g_ao, v, out=out, tiling=tiling, stream_k=stream_k)
    assert got is out and _close(out, g_ao.float() @ v.float().transpose(-1, -2))
    again = matmul_nt_batched(g_ao, v, tiling=tiling, stream_k=stream_k)
    assert torch.equal(again, out)


@pytest.mark.gpu
@pytest.mark.parametrize("b,heads,s", [(2, 4, 200), (3, 2, 72)])  # 2 x 1 clusters from s > 128, none below
def test_probabilities_times_head_values_and_back(b, heads, s):
    """056's P . v and dv = P^T . g_ao per (batch, head) with their default tiling (one
    160-column head a tile), written into and read from [b, s, heads * d] rows."""
    g = torch.Generator(device="cuda").manual_seed(s)
    p = torch.softmax(torch.randn(b, heads, s, s, device="cuda", generator=g), -1).bfloat16()
    v, g_ao = _heads(b, s, heads, 160, g), _heads(b, s, heads, 160, g)
    rows = torch.full((b, s, heads * 160), float("nan"), dtype=torch.bfloat16, device="cuda")
    pv = rows.view(b, s, heads, 160).transpose(1, 2)
    matmul_nt_batched(p, v.transpose(-1, -2), out=pv)
    assert _close(pv, p.float() @ v.float())
    dv = matmul_nt_batched(p.transpose(-1, -2), g_ao.transpose(-1, -2))
    assert _close(dv, p.float().transpose(-1, -2) @ g_ao.float())


@pytest.mark.gpu
def test_one_batch_dimension_and_empty_batches():
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(5, 96, 64, device="cuda", generator=g).bfloat16()
    b = torch.randn(5, 80, 64, device="cuda", generator=g).bfloat16().transpose(1, 2).contiguous().transpose(1, 2)
    got = matmul_nt_batched(a, b, out_dtype=torch.float32)
    assert got.shape == (5, 96, 80) and _close(got, a.float() @ b.float().transpose(1, 2), 1e-5)
    fewer = matmul_nt_batched(a[:3], b[:3], out_dtype=torch.float32)  # another batch size: another schedule
    assert torch.equal(fewer, got[:3])
    assert matmul_nt_batched(a[:0], b[:0]).shape == (0, 96, 80)


@pytest.mark.gpu
@pytest.mark.parametrize("s,stream_k,rows_by_token", [(200, None, False), (200, None, True), (512, True, True)])
def test_batched_softmax_backward(s, stream_k, rows_by_token):
    """g_s = P * (g_p - D) / sqrt(d) per (batch, head), D = rowsum(P * g_p); D contiguous, or
    (rows_by_token) read in place as 056 has it: the [b, heads, s] view of a [b, s, heads] tensor."""
    b, heads, d = 2, 3, 160
    g = torch.Generator(device="cuda").manual_seed(s)
    g_ao, v = _heads(b, s, heads, d, g), _heads(b, s, heads, d, g)
    p = torch.softmax(2 * torch.randn(b, heads, s, s, device="cuda", generator=g), -1).bfloat16()
    g_p = g_ao.float() @ v.float().transpose(-1, -2)
    rows = (p.float() * g_p).sum(-1)
    if rows_by_token:
        rows = rows.transpose(1, 2).contiguous().transpose(1, 2)
        assert rows.stride() == (s * heads, 1, heads)
    want = p.float() * (g_p - rows[..., None]) * d**-0.5
    got = matmul_nt_batched(g_ao, v, epilogue="softmax_bwd", inputs=(p,), rows=rows, alpha=d**-0.5,
                            stream_k=stream_k)
    assert _close(got, want)


@pytest.mark.gpu
def test_batched_rope_inverse_with_tables_shared_by_heads():
    """g_q = inverse RoPE of g_qr = g_s . k_rep per (batch, head), cos/sin [b, s, d] expanded
    over the heads (stride 0), g_q written into a [b, s, heads * d] tensor's head view."""
    b, heads, s, d = 2, 4, 136, 160
    g = torch.Generator(device="cuda").manual_seed(3)
    g_s = torch.randn(b, heads, s, s, device="cuda", generator=g).bfloat16()
    k_rep = _heads(b, s, heads, d, g)
    angles = torch.rand(b, s, d // 2, device="cuda", generator=g).repeat(1, 1, 2) * 6.3
    cos, sin = (t.bfloat16().unsqueeze(1).expand(b, heads, s, d) for t in (angles.cos(), angles.sin()))
    g_qr = g_s.float() @ k_rep.float()
    rotated = torch.cat([-g_qr[..., d // 2:], g_qr[..., :d // 2]], -1)
    want = g_qr * cos.float() - rotated * sin.float()
    flat = torch.full((b, s, heads * d), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = flat.view(b, s, heads, d).transpose(1, 2)
    matmul_nt_batched(g_s, k_rep.transpose(-1, -2), out=out, epilogue="rope_inverse", inputs=(cos, sin))
    assert _close(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("b,kv_heads,group,s,stream_k", [(2, 2, 4, 211, None), (1, 3, 2, 72, True),
                                                         (2, 1, 4, 300, False)])
def test_batch_sums_over_each_kv_heads_query_heads(b, kv_heads, group, s, stream_k):
    """056's dv = sum over a kv head's query heads of P^T . g_ao, and dk = inverse RoPE of the
    same sum of g_s^T . q_rot, each one product (group_sum) written into a [b, s, kv_heads * d]
    tensor's head view; poisoned outputs, fp32 reference, bitwise repeatable."""
    heads, d = kv_heads * group, 160
    g = torch.Generator(device="cuda").manual_seed(s + group)
    def scores(values):  # [b, heads, s, s] in rows padded to 16 bytes, as 056 holds P and g_s
        padded = torch.empty(b, heads, s, -(-s // 8) * 8, dtype=torch.bfloat16, device="cuda")
        return padded[..., :s].copy_(values)

    p = scores(torch.softmax(torch.randn(b, heads, s, s, device="cuda", generator=g), -1))
    g_ao, q_rot = _heads(b, s, heads, d, g), _heads(b, s, heads, d, g)
    g_s = scores(torch.randn(b, heads, s, s, device="cuda", generator=g) / s)
    angles = torch.rand(b, s, d // 2, device="cuda", generator=g).repeat(1, 1, 2) * 6.3
    cos, sin = (t.bfloat16().unsqueeze(1).expand(b, kv_heads, s, d) for t in (angles.cos(), angles.sin()))

    def group_sums(per_head):  # [b, heads, s, d] -> [b, kv_heads, s, d]
        return per_head.view(b, kv_heads, group, s, d).sum(2)

    want_dv = group_sums(p.float().transpose(-1, -2) @ g_ao.float())
    g_kr = group_sums(g_s.float().transpose(-1, -2) @ q_rot.float())
    want_dk = g_kr * cos.float() - torch.cat([-g_kr[..., d // 2:], g_kr[..., :d // 2]], -1) * sin.float()
    runs = []
    for _ in range(2):
        dv, dk = (torch.full((b, s, kv_heads * d), float("nan"), dtype=torch.bfloat16, device="cuda")
                  .view(b, s, kv_heads, d).transpose(1, 2) for _ in range(2))
        matmul_nt_batched(p.transpose(-1, -2), g_ao.transpose(-1, -2), out=dv, group_sum=group, stream_k=stream_k)
        matmul_nt_batched(g_s.transpose(-1, -2), q_rot.transpose(-1, -2), out=dk, epilogue="rope_inverse",
                          inputs=(cos, sin), group_sum=group, stream_k=stream_k)
        assert _close(dv, want_dv) and _close(dk, want_dk)
        runs.append((dv, dk))
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    new = matmul_nt_batched(p.transpose(-1, -2), g_ao.transpose(-1, -2), group_sum=group, stream_k=stream_k)
    assert new.shape == (b, kv_heads, s, d) and torch.equal(new, runs[0][0])


@pytest.mark.gpu
def test_batch_sum_shapes_are_checked():
    a = torch.zeros(2, 6, 64, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="^group_sum: 4 does not divide a's batch dimension 6"):
        matmul_nt_batched(a, a, group_sum=4)
    matmul_nt_batched(a, a, group_sum=3)  # a cached shape: the next calls take the fast path
    with pytest.raises(ValueError, match=r"^out: expected the batch shape \[2, 2\] in front"):
        matmul_nt_batched(a, a, out=torch.zeros(2, 3, 64, 64, dtype=torch.bfloat16, device="cuda"), group_sum=3)


@pytest.mark.gpu
def test_batched_argument_errors_name_the_tensor():
    a = torch.zeros(2, 3, 64, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"^b: expected the batch shape \[2, 3\] in front"):
        matmul_nt_batched(a, a[:, :2])
    rows_of_61 = torch.zeros(2 * 3 * 64 * 61 + 3, dtype=torch.bfloat16, device="cuda").as_strided(
        (2, 3, 64, 64), (3 * 64 * 61, 64 * 61, 61, 1))  # a row stride of 122 bytes: TMA cannot step it
    with pytest.raises(ValueError, match="^b: the non-contiguous stride must be a multiple of 8"):
        matmul_nt_batched(a, rows_of_61)
    shared = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16, device="cuda").expand(2, 3, 64, 64)
    with pytest.raises(ValueError, match=r"^b: TMA cannot broadcast \(a zero batch stride\)"):
        matmul_nt_batched(a, shared)
    with pytest.raises(ValueError, match="^b: batch strides must be multiples of 16 bytes"):
        matmul_nt_batched(a, torch.zeros(2 * 3 * 64 * 64 + 3, dtype=torch.bfloat16, device="cuda").as_strided(
            (2, 3, 64, 64), (3 * 64 * 64 + 3, 64 * 64, 64, 1)))
