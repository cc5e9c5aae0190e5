"""Grouped products and sums of products (kernels/gemm/grouped.py): argument errors on
any machine; on the GPU, every result against fp32 PyTorch on sizes that are not tile
multiples, with results poisoned before the call."""
import pytest
import torch

from cutebwd.kernels.gemm import matmul_nt_grouped, matmul_nt_summed
from cutebwd.layouts.gemm import GemmTiling
from cutebwd.tools.parity import relative_error


def test_group_size_and_outs_are_checked_first():
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^a_list: a list of two or three operands, got 1"):
        matmul_nt_grouped([a], a)
    with pytest.raises(ValueError, match="^a_list: a list of two or three operands, got 4"):
        matmul_nt_grouped([a] * 4, a)
    with pytest.raises(ValueError, match="^a_list: a list of two or three operands, got Tensor"):
        matmul_nt_grouped(a, a)
    with pytest.raises(ValueError, match=r"^outs: one per operand \(2\), got 3"):
        matmul_nt_grouped([a, a], a, outs=[a, a, a])
    with pytest.raises(ValueError, match=r"^pairs: a list of two or three \(a, b\) pairs"):
        matmul_nt_summed([(a, a)], out=None)
    with pytest.raises(ValueError, match=r"^pairs: a list of two or three \(a, b\) pairs"):
        matmul_nt_summed([(a, a), (a,)])


def _group(ms, n, k, k_major, seed):
    """A_i [M_i, K] (K- or M-major views), B [N, K] (N-major, as X^T of a weight gradient)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a_list = [torch.randn(m, k, device="cuda", generator=g).bfloat16() if k_major
              else torch.randn(k, m, device="cuda", generator=g).bfloat16().t() for m in ms]
    b = torch.randn(k, n, device="cuda", generator=g).bfloat16().t()
    return a_list, b


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [None, GemmTiling(tile_n=256, cluster_m=2), GemmTiling(pingpong=True, cluster_m=2),
                                    GemmTiling(tile_m=64, tile_n=128, cluster_m=2),
                                    GemmTiling(tile_m=64, tile_n=128, cluster_m=4)],  # 051's weight gradients
                         ids=lambda t: t.spec if t else "default")
@pytest.mark.parametrize("ms,n,k,k_major,stream_k", [
    ((296, 136, 520), 776, 200, False, None),  # weight-gradient shape: A = dY^T views (M-major), K = T short
    ((640, 160), 520, 2600, True, True),  # forced stream-K across the products' tiles
    ((1, 257, 129), 264, 64, True, False),  # single-row and ragged products
])
def test_grouped_products_match_each_product(ms, n, k, k_major, stream_k, tiling):
    a_list, b = _group(ms, n, k, k_major, seed=sum(ms) + n)
    outs = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda") for m in ms]
    got = matmul_nt_grouped(a_list, b, outs=outs, tiling=tiling, stream_k=stream_k)
    assert all(x is y for x, y in zip(got, outs))
    for i, (a, out) in enumerate(zip(a_list, outs)):
        assert relative_error(out, a.float() @ b.float().t()) < 1e-2, f"product {i}"


@pytest.mark.gpu
def test_grouped_allocates_fp32_repeats_bitwise_and_handles_empty_products():
    a_list, b = _group((200, 72, 328), 256, 384, False, seed=3)
    first = matmul_nt_grouped(a_list, b, out_dtype=torch.float32, stream_k=True)
    again = matmul_nt_grouped(a_list, b, out_dtype=torch.float32, stream_k=True)
    assert all(x.dtype == torch.float32 and torch.equal(x, y) for x, y in zip(first, again))
    for a, out in zip(a_list, first):
        assert relative_error(out, a.float() @ b.float().t()) < 1e-4
    empty = torch.zeros(0, 384, dtype=torch.bfloat16, device="cuda")
    got = matmul_nt_grouped([a_list[0], empty, a_list[2]], b)
    assert got[1].shape == (0, 256)
    assert relative_error(got[2], a_list[2].float() @ b.float().t()) < 1e-2


@pytest.mark.gpu
def test_grouped_argument_errors_name_the_operand():
    a_list, b = _group((64, 32), 128, 64, True, seed=1)
    with pytest.raises(ValueError, match=r"^a_list\[1\] is \[32, 72\] and b is \[128, 64\]"):
        matmul_nt_grouped([a_list[0], torch.zeros(32, 72, dtype=torch.bfloat16, device="cuda")], b)
    with pytest.raises(ValueError, match="^a_list: every operand K-major, or every one M-major"):
        matmul_nt_grouped([a_list[0], a_list[1].t().contiguous().t()], b)
    with pytest.raises(TypeError, match=r"^outs\[0\]: expected dtype"):
        matmul_nt_grouped(a_list, b, outs=[torch.zeros(64, 128, dtype=torch.float16, device="cuda"), None])
    with pytest.raises(ValueError, match=r"^outs: one dtype for all results"):
        matmul_nt_grouped(a_list, b, outs=[torch.zeros(64, 128, device="cuda"),
                                           torch.zeros(32, 128, dtype=torch.bfloat16, device="cuda")])


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [None, GemmTiling(tile_n=256, cluster_m=2), GemmTiling(pingpong=True, cluster_m=2)],
                         ids=lambda t: t.spec if t else "default")
@pytest.mark.parametrize("m,n,ks,stream_k", [
    (300, 776, (520, 136, 136), None),  # 056's q/k/v input gradient, scaled down: dX = dQ . Wq + dK . Wk + dV . Wv
    (1000, 520, (2600, 72), True),  # forced stream-K across the terms' k-tiles
    (129, 264, (8, 1000, 40), False),  # a term shorter than one k-tile
])
def test_summed_products_match_the_sum(m, n, ks, stream_k, tiling):
    g = torch.Generator(device="cuda").manual_seed(m + n + sum(ks))
    pairs = [(torch.randn(m, k, device="cuda", generator=g).bfloat16(),  # dY_i [T, out_i], K-major
              torch.randn(k, n, device="cuda", generator=g).bfloat16().t()) for k in ks]  # W_i^T views, N-major
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert matmul_nt_summed(pairs, out=out, tiling=tiling, stream_k=stream_k) is out
    want = sum(a.float() @ b.float().t() for a, b in pairs)
    assert relative_error(out, want) < 1e-2


@pytest.mark.gpu
def test_summed_fp32_repeats_bitwise_and_skips_empty_terms():
    g = torch.Generator(device="cuda").manual_seed(7)
    pairs = [(torch.randn(200, k, device="cuda", generator=g).bfloat16(),
              torch.randn(256, k, device="cuda", generator=g).bfloat16()) for k in (384, 128, 64)]
    first = matmul_nt_summed(pairs, out_dtype=torch.float32, stream_k=True)
    assert first.dtype == torch.float32 and torch.equal(first, matmul_nt_summed(pairs, out_dtype=torch.float32,
                                                                                  stream_k=True))
    assert relative_error(first, sum(a.float() @ b.float().t() for a, b in pairs)) < 1e-4
    empty = (torch.zeros(200, 0, dtype=torch.bfloat16, device="cuda"), torch.zeros(256, 0, dtype=torch.bfloat16,
                                                                                    device="cuda"))
    got = matmul_nt_summed([pairs[0], empty, pairs[2]])
    want = pairs[0][0].float() @ pairs[0][1].float().t() + pairs[2][0].float() @ pairs[2][1].float().t()
    assert relative_error(got, want) < 1e-2


@pytest.mark.gpu
def test_summed_argument_errors_name_the_term():
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    a, b = torch.zeros(64, 32, **bf16), torch.zeros(128, 32, **bf16)
    with pytest.raises(ValueError, match=r"^pairs\[1\]\[0\] is \[64, 40\] and pairs\[1\]\[1\] is \[128, 32\]"):
        matmul_nt_summed([(a, b), (torch.zeros(64, 40, **bf16), b)])
    with pytest.raises(ValueError, match=r"^pairs: every term \[M, K_i\] . \[N, K_i\]\^T with one M and N"):
        matmul_nt_summed([(a, b), (torch.zeros(32, 32, **bf16), b)])
    with pytest.raises(ValueError, match="^pairs: every b K-major, or every one the other way"):
        matmul_nt_summed([(a, b), (a, b.t().contiguous().t())])
