"""L1/013 fused residual RMSNorm backward (Qwen3-4B): the contract in plain PyTorch.

Forward: x = hidden_states + residual (fp32), normalized = x * rstd(x), y = weight * normalized.
The backward gives the same gradient to both summands, returned as two tensors, and computes
it from `normalized`: x is in the signature and not read.
"""

import torch

from .inputs import InputDraw, as_dtype, model_dims, rsqrt_mean_square
from .rmsnorm import Evaluation, normalized_dx

bf16, fp32 = torch.bfloat16, torch.float32

DIMS = {"hidden": 2560}
EPS = 1e-6  # Qwen3 rms_norm_eps; the backward gets rstd, so only the generator uses it
INPUTS = ("grad_output", "x", "normalized", "rstd", "weight")
OUTPUTS = ("grad_hidden_states", "grad_residual", "grad_weight")
OUTPUT_DTYPES = (bf16, bf16, fp32)
UNREAD_INPUTS = ("x",)


def fused_residual_rmsnorm_backward(grad_output, x, normalized, rstd, weight, *, exact=False):
    """-> grad_hidden_states, grad_residual, grad_weight.

    normalized=None: the option that reads x and computes normalized = x * rstd (in a real
    model the two agree); otherwise x is not read.
    """
    ev = Evaluation(exact)
    hidden = grad_output.shape[-1]
    g = ev(grad_output).reshape(-1, hidden)
    rstd = ev(rstd).reshape(-1, 1)
    if normalized is None:
        normalized = ev(x).reshape(-1, hidden) * rstd
    else:
        normalized = ev(normalized).reshape(-1, hidden)

    grad_weight = (g * normalized).sum(0)
    dx = normalized_dx(g * ev(weight), normalized, rstd).reshape(grad_output.shape)
    return ev.finish((dx, dx.clone(), grad_weight), OUTPUT_DTYPES)


def forward_leaves(batch, seq, *, device="cpu", seed=0, dims=None, dtype=None):
    """The forward pass's leaves and the upstream gradient, drawn from `seed`."""
    hidden = model_dims(DIMS, dims)["hidden"]
    draw = InputDraw(seed, device, dtype)
    return {
        "hidden_states": draw.randn((batch, seq, hidden), fp32),
        "residual": draw.randn((batch, seq, hidden), fp32),
        "weight": draw.randn((hidden,), fp32),
        "grad_output": draw.randn((batch, seq, hidden), bf16),
    }


def forward(leaves, *, eps=EPS):
    """-> ({upstream gradient name: output}, saved tensors), differentiable in the leaves."""
    x = leaves["hidden_states"] + leaves["residual"]
    rstd = rsqrt_mean_square(x, eps)
    normalized = x * rstd
    return {"grad_output": leaves["weight"] * normalized}, {"x": x, "normalized": normalized, "rstd": rstd}


def make_inputs(batch, seq, *, device="cpu", seed=0, dims=None, consistent=False, dtype=None):
    """Inputs in signature order: the benchmark's independent random tensors, or with
    consistent=True the saved tensors of a real forward pass."""
    if consistent:
        leaves = forward_leaves(batch, seq, device=device, seed=seed, dims=dims, dtype=dtype)
        with torch.no_grad():
            _, saved = forward(leaves)
        return (
            leaves["grad_output"],
            as_dtype(saved["x"], fp32, dtype),
            as_dtype(saved["normalized"], fp32, dtype),
            as_dtype(saved["rstd"], fp32, dtype),
            leaves["weight"],
        )
    hidden = model_dims(DIMS, dims)["hidden"]
    draw = InputDraw(seed, device, dtype)
    shape = (batch, seq, hidden)
    return (
        draw.randn(shape, bf16),
        draw.randn(shape, fp32),
        draw.randn(shape, fp32),
        draw.rstd((batch, seq, 1), fp32),
        draw.randn((hidden,), fp32),
    )
