"""A gated MLP as one autograd function (kernels/gated_mlp.py), Gemma's gelu_tanh and the others'
silu: the forward bitwise transformers' operations; the gradients held to the rules of test_modules.py: the benchmark's closeness test
against the kernels' arithmetic in PyTorch (the reference), and an error against float64
autograd at most twice that of PyTorch's own bf16 autograd, plus 1e-5."""
import pytest
import torch

from cutebwd.kernels.gated_mlp import gated_mlp, gated_mlp_backward_reference, gelu_tanh_and_slope
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


def _activation(name):
    if name == "silu":
        return torch.nn.functional.silu
    return lambda t: torch.nn.functional.gelu(t, approximate="tanh")


def _plain(activation):
    """transformers' MLP forward (Gemma3MLP with gelu_tanh, LlamaMLP with silu)."""
    linear, act = torch.nn.functional.linear, _activation(activation)
    return lambda x, wg, wu, wd: linear(act(linear(x, wg)) * linear(x, wu), wd)


def _ours(activation):
    return lambda x, wg, wu, wd: gated_mlp(x, wg, wu, wd, activation)


def _gradients(forward, x, weights, upstream):
    leaves = [x.detach().requires_grad_(), *(w.detach().requires_grad_() for w in weights)]
    out = forward(*leaves)
    return out, torch.autograd.grad(out, leaves, upstream.to(out.dtype))


def _check(batch, seq, hidden, inner, device, activation):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, hidden, generator=g).to(device, torch.bfloat16)
    upstream = torch.randn(batch, seq, hidden, generator=g).to(device, torch.bfloat16)
    weights = _weights(hidden, inner, device, torch.bfloat16)
    out, got = _gradients(_ours(activation), x, weights, upstream)
    plain, autograd = _gradients(_plain(activation), x, weights, upstream)
    assert torch.equal(out, plain)  # transformers' operations, op for op
    _, exact = _gradients(_plain(activation), x.double(), [w.double() for w in weights], upstream)
    linear = torch.nn.functional.linear
    gate, up = linear(x, weights[0]), linear(x, weights[1])
    act = _activation(activation)(gate)
    contract = gated_mlp_backward_reference(upstream, x, gate, up, act * up, act if activation == "silu" else None,
                                            *weights, activation)
    context = f"gated_mlp ({activation}) on {device}"
    assert_parity(NAMES, list(got), list(contract), ATOL, context=context)
    against_autograd = check_outputs(NAMES, list(got), list(autograd), ATOL, list(exact))
    assert all(r.accuracy_ok for r in against_autograd), "\n".join([context, *(r.line() for r in against_autograd)])


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_gradients_on_cpu(activation):
    """The wiring, with the reference as the backward."""
    _check(2, 7, 64, 128, "cpu", activation)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq,hidden,inner,activation", [
    (2, 64, 64, 128, "gelu_tanh"), (4, 512, 640, 2048, "gelu_tanh"), (1, 300, 1152, 6912, "gelu_tanh"),
    (2, 64, 64, 128, "silu"), (2, 512, 2560, 9728, "silu"),  # Qwen3-4B's widths
])
def test_gradients_on_the_gpu(batch, seq, hidden, inner, activation):
    """The four GEMM launches: small, Gemma-3-270m's and 1B's widths; silu at Qwen3-4B's."""
    _check(batch, seq, hidden, inner, "cuda", activation)


def test_widths_the_kernels_do_not_take_run_the_reference():
    """H = 60 (not a multiple of 8): the PyTorch arithmetic, the same rules."""
    _check(1, 5, 60, 96, "cpu", "gelu_tanh")


def test_refuses_other_activations():
    with pytest.raises(ValueError, match="activation: one of"):
        gated_mlp(*_weights(8, 16, "cpu", torch.bfloat16)[:1], *_weights(8, 16, "cpu", torch.bfloat16), "relu")


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
    ours, plain = _ours("gelu_tanh"), _plain("gelu_tanh")
    for forward in (ours, plain):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, e in zip(params, earlier):
            p.grad = e.clone()
        held = [p.grad for p in params]
        seen = []
        params[0].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        forward(x, *params).backward(upstream)
        assert len(seen) == 1 and torch.equal(seen[0], params[0].grad)
        if forward is ours:
            assert all(p.grad is t for p, t in zip(params, held))  # added into, not replaced
        summed[forward] = [p.grad for p in params]
    for got, want, name in zip(summed[ours], summed[plain], NAMES[1:]):
        assert (got.float() - want.float()).norm() <= 1e-2 * want.float().norm(), name
