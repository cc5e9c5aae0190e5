"""Gemma's MLP as one autograd function (kernels/geglu_mlp.py): the forward bitwise transformers'
operations; the gradients held to the rules of test_modules.py: the benchmark's closeness test
against the kernels' arithmetic in PyTorch (the reference), and an error against float64
autograd at most twice that of PyTorch's own bf16 autograd, plus 1e-5."""
import pytest
import torch

from cutebwd.kernels.geglu_mlp import geglu_mlp, geglu_mlp_backward_reference, gelu_tanh_and_slope
from cutebwd.tools.parity import assert_parity, check_outputs

NAMES = ("x", "gate_proj", "up_proj", "down_proj")
ATOL = 0.016  # as the patched models' tests (tests/test_hf_patch.py)


def test_the_slope_is_gelu_tanhs_derivative():
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64).requires_grad_()
    value = torch.nn.functional.gelu(x, approximate="tanh")
    (slope,) = torch.autograd.grad(value.sum(), x)
    ours, our_slope = gelu_tanh_and_slope(x.detach())
    torch.testing.assert_close(ours, value.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(our_slope, slope, rtol=0, atol=1e-12)


def _weights(hidden, inner, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, cols, generator=g) / cols**0.5).to(device, dtype)
            for rows, cols in ((inner, hidden), (inner, hidden), (hidden, inner))]


def _plain(x, gate_weight, up_weight, down_weight):
    """transformers' Gemma3MLP forward."""
    linear = torch.nn.functional.linear
    return linear(torch.nn.functional.gelu(linear(x, gate_weight), approximate="tanh") * linear(x, up_weight),
                  down_weight)


def _gradients(forward, x, weights, upstream):
    leaves = [x.detach().requires_grad_(), *(w.detach().requires_grad_() for w in weights)]
    out = forward(*leaves)
    return out, torch.autograd.grad(out, leaves, upstream.to(out.dtype))


def _check(batch, seq, hidden, inner, device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, hidden, generator=g).to(device, torch.bfloat16)
    upstream = torch.randn(batch, seq, hidden, generator=g).to(device, torch.bfloat16)
    weights = _weights(hidden, inner, device, torch.bfloat16)
    out, got = _gradients(geglu_mlp, x, weights, upstream)
    plain, autograd = _gradients(_plain, x, weights, upstream)
    assert torch.equal(out, plain)  # transformers' operations, op for op
    _, exact = _gradients(_plain, x.double(), [w.double() for w in weights], upstream)
    linear = torch.nn.functional.linear
    gate, up = linear(x, weights[0]), linear(x, weights[1])
    h = torch.nn.functional.gelu(gate, approximate="tanh") * up
    contract = geglu_mlp_backward_reference(upstream, x, gate, up, h, *weights)
    context = f"geglu_mlp on {device}"
    assert_parity(NAMES, list(got), list(contract), ATOL, context=context)
    against_autograd = check_outputs(NAMES, list(got), list(autograd), ATOL, list(exact))
    assert all(r.accuracy_ok for r in against_autograd), "\n".join([context, *(r.line() for r in against_autograd)])


def test_gradients_on_cpu():
    """The wiring, with the reference as the backward."""
    _check(2, 7, 64, 128, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq,hidden,inner", [(2, 64, 64, 128), (4, 512, 640, 2048), (1, 300, 1152, 6912)])
def test_gradients_on_the_gpu(batch, seq, hidden, inner):
    """The four GEMM launches: small, Gemma-3-270m's and 1B's widths."""
    _check(batch, seq, hidden, inner, "cuda")


def test_widths_the_kernels_do_not_take_run_the_reference():
    """H = 60 (not a multiple of 8): the PyTorch arithmetic, the same rules."""
    _check(1, 5, 60, 96, "cpu")


@pytest.mark.gpu
def test_weight_gradients_accumulate_in_place_on_the_gpu():
    """With gradients already in `.grad` (accumulation over micro batches) the backward adds into
    them in place; the sums match PyTorch's accumulation and post-accumulate hooks still run."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, 640, generator=g).to("cuda", torch.bfloat16)
    upstream = torch.randn(2, 128, 640, generator=g).to("cuda", torch.bfloat16)
    weights = _weights(640, 2048, "cuda", torch.bfloat16)
    earlier = [torch.randn(w.shape, generator=g).to("cuda", torch.bfloat16) for w in weights]
    summed = {}
    for forward in (geglu_mlp, _plain):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, e in zip(params, earlier):
            p.grad = e.clone()
        held = [p.grad for p in params]
        seen = []
        params[0].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        forward(x, *params).backward(upstream)
        assert len(seen) == 1 and torch.equal(seen[0], params[0].grad)
        if forward is geglu_mlp:
            assert all(p.grad is t for p, t in zip(params, held))  # added into, not replaced
        summed[forward] = [p.grad for p in params]
    for got, want, name in zip(summed[geglu_mlp], summed[_plain], NAMES[1:]):
        assert (got.float() - want.float()).norm() <= 1e-2 * want.float().norm(), name
