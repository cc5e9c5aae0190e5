"""Gemma's MLP, down(gelu_tanh(gate(x)) * up(x)), as one autograd function whose backward is four
GEMM launches (kernels/gemm):

    1  g_gate, g_up = dgeglu epilogue of g_y . Wd   (g_h never stored; gelu_tanh recomputed from gate)
    2  dWd = g_y^T . h
    3  dx = g_gate . Wg + g_up . Wu                  (one sum of two products)
    4  dWg, dWu = g_gate^T . x, g_up^T . x           (one group sharing x)

where eager autograd runs about eleven kernels (the three linear layers' six products, the
product's two multiplies, the gelu backward and the sum of x's two gradients) and builds five
autograd nodes. A small model's backward is bound by host time per launch.

    geglu_mlp(x, gate_weight, up_weight, down_weight) -> y
        the forward is transformers' own operations (bitwise its output); it saves x, gate, up
        and h = gelu_tanh(gate) * up (eager autograd saves gelu_tanh(gate) as well).

On CUDA bf16 tensors whose widths are multiples of 8 the backward is the kernels (as the custom
operator torch.ops.cutebwd.geglu_mlp_backward under torch.compile), adding the weights'
gradients into their `.grad` in place where gradients accumulate (modules.gradient_to_add_into:
one add launch a weight less); elsewhere it is the same
arithmetic in PyTorch (geglu_mlp_backward_reference), fp32 throughout with g_gate and g_up
rounded to bf16 as the epilogue stores them.
"""
from __future__ import annotations

import torch

from .modules import gradient_to_add_into
from .torch_ops import op

GELU_TANH_K0, GELU_TANH_K1 = 0.7978845608028654, 0.044715  # sqrt(2 / pi); the cubic term's weight


class _GegluMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight):
        gate = torch.nn.functional.linear(x, gate_weight)
        up = torch.nn.functional.linear(x, up_weight)
        h = torch.nn.functional.gelu(gate, approximate="tanh") * up
        ctx.save_for_backward(x, gate, up, h, gate_weight, up_weight, down_weight)
        return torch.nn.functional.linear(h, down_weight)

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        x, gate = saved[:2]
        rows = (grad_output.contiguous(), *saved)
        if not (x.is_cuda and kernels_read(x, gate, *saved[4:])):
            return geglu_mlp_backward_reference(*rows)
        into = [gradient_to_add_into(w) for w in saved[4:]]
        if any(g is not None for g in into):
            return geglu_mlp_backward(*rows, into=into)
        return op("geglu_mlp_backward")(*rows)


def kernels_read(x, gate, *weights) -> bool:
    """What the GEMM kernels take here: bf16 activations and weights, widths multiples of 8 (TMA's
    16-byte strides), some tokens."""
    return (all(t.dtype == torch.bfloat16 for t in (x, gate, *weights)) and x.shape[-1] % 8 == 0
            and gate.shape[-1] % 8 == 0 and x.numel() > 0)


def gelu_tanh_and_slope(gate32):
    """(gelu_tanh(x), its derivative) in fp32, the dgeglu epilogue's formula."""
    x2 = gate32 * gate32
    t = torch.tanh(GELU_TANH_K0 * gate32 * (1.0 + GELU_TANH_K1 * x2))
    half = 0.5 * (1.0 + t)
    return gate32 * half, half + 0.5 * gate32 * (1.0 - t * t) * GELU_TANH_K0 * (1.0 + 3.0 * GELU_TANH_K1 * x2)


def geglu_mlp_backward(grad_output, x, gate, up, h, gate_weight, up_weight, down_weight, into=(None, None, None)):
    """-> (grad_x [..., H], grad_gate_weight, grad_up_weight [I, H], grad_down_weight [H, I]), bf16,
    by the four launches of the module docstring; grad_output, x [..., H], gate, up, h [..., I]
    bf16 with contiguous rows. `into`: per weight, a gradient to add its own into in place (the
    `add` epilogue), returned as None: the down projection's, and the gate's and up's together
    (two launches for the two, where the fresh pair is one)."""
    from .gemm import matmul_nt, matmul_nt_grouped, matmul_nt_summed

    g_y, x2, gate2, up2, h2 = (t.reshape(-1, t.shape[-1]) for t in (grad_output, x, gate, up, h))
    g_gate, g_up = matmul_nt(g_y, down_weight.t(), epilogue="dgeglu", inputs=(gate2, up2))
    into_gate, into_up, into_down = into
    grad_down_weight = None
    if into_down is not None:
        matmul_nt(g_y.t(), h2.t(), out=into_down, epilogue="add")
    else:
        grad_down_weight = matmul_nt(g_y.t(), h2.t())
    grad_x = matmul_nt_summed([(g_gate, gate_weight.t()), (g_up, up_weight.t())])
    grad_gate_weight = grad_up_weight = None
    if into_gate is not None and into_up is not None:
        matmul_nt(g_gate.t(), x2.t(), out=into_gate, epilogue="add")
        matmul_nt(g_up.t(), x2.t(), out=into_up, epilogue="add")
    else:
        grad_gate_weight, grad_up_weight = matmul_nt_grouped([g_gate.t(), g_up.t()], x2.t())
    return grad_x.view(x.shape), grad_gate_weight, grad_up_weight, grad_down_weight


def geglu_mlp_backward_reference(grad_output, x, gate, up, h, gate_weight, up_weight, down_weight):
    """The kernels' arithmetic in PyTorch: fp32 products, g_gate and g_up rounded to bf16 (as the
    epilogue stores them), each result rounded once to its tensor's dtype."""
    g_y, x2, gate2, up2, h2 = (t.reshape(-1, t.shape[-1]).float() for t in (grad_output, x, gate, up, h))
    g_h = g_y @ down_weight.float()
    act, slope = gelu_tanh_and_slope(gate2)
    g_gate, g_up = (g.to(torch.bfloat16).float() for g in (g_h * up2 * slope, g_h * act))
    grad_x = g_gate @ gate_weight.float() + g_up @ up_weight.float()
    return (grad_x.to(x.dtype).view(x.shape), (g_gate.t() @ x2).to(gate_weight.dtype),
            (g_up.t() @ x2).to(up_weight.dtype), (g_y.t() @ h2).to(down_weight.dtype))


def geglu_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
              down_weight: torch.Tensor) -> torch.Tensor:
    """Gemma's MLP on x [..., H] with bias-free weights gate, up [I, H] and down [H, I] (module
    docstring)."""
    return _GegluMLPFunction.apply(x, gate_weight, up_weight, down_weight)
