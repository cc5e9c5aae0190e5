"""A gated MLP, down(act(gate(x)) * up(x)), as one autograd function whose backward is four GEMM
launches (kernels/gemm):

    1  g_gate, g_up from g_h = g_y . Wd by a fused epilogue (g_h never stored): `dgeglu` for
       Gemma's gelu_tanh (recomputed from gate), `dswiglu` for silu (Llama, Qwen3, Mistral: the
       epilogue's roles swapped, since it puts silu on its second input, and silu(gate) read as
       the forward saved it)
    2  dWd = g_y^T . h
    3  dx = g_gate . Wg + g_up . Wu                  (one sum of two products)
    4  dWg, dWu = g_gate^T . x, g_up^T . x           (one group sharing x)

where eager autograd runs about ten kernels (the three linear layers' six products, the
product's two multiplies, the activation's backward and the sum of x's two gradients) through
five autograd nodes. A small model's backward is bound by host time per launch.

    gated_mlp(x, gate_weight, up_weight, down_weight, activation) -> y
        activation "gelu_tanh" or "silu"; the forward is transformers' own operations (bitwise
        its output); it saves x, gate, up, h = act(gate) * up and, for silu, act(gate).

On CUDA bf16 tensors whose widths are multiples of 8 the backward is the kernels (as the custom
operator torch.ops.cutebwd.gated_mlp_backward under torch.compile), adding the weights'
gradients into their `.grad` in place where gradients accumulate (modules.gradient_to_add_into:
one add launch a weight less); elsewhere it is the same arithmetic in PyTorch
(gated_mlp_backward_reference), fp32 throughout with g_gate and g_up rounded to bf16 as the
epilogue stores them.
"""

from __future__ import annotations

import torch

from .modules import accumulation_nodes, gradient_to_add_into
from .torch_ops import op

GELU_TANH_K0, GELU_TANH_K1 = 0.7978845608028654, 0.044715  # sqrt(2 / pi); the cubic term's weight
ACTIVATIONS = ("gelu_tanh", "silu")


class _GatedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, activation):
        y, saved = gated_mlp_forward(x, gate_weight, up_weight, down_weight, activation)
        ctx.save_for_backward(*saved, gate_weight, up_weight, down_weight)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        grads = gated_mlp_grads(grad_output, saved[:5], saved[5:], ctx.activation, accumulation_nodes(ctx, 1, 3))
        return (*grads, None)


def gated_mlp_forward(x, gate_weight, up_weight, down_weight, activation: str):
    """(y, what gated_mlp_grads reads: x, gate, up, h and silu's act(gate) or None), transformers'
    own operations."""
    gate = torch.nn.functional.linear(x, gate_weight)
    up = torch.nn.functional.linear(x, up_weight)
    if activation == "silu":
        act = torch.nn.functional.silu(gate)
        h = act * up
    else:
        act, h = None, torch.nn.functional.gelu(gate, approximate="tanh") * up
    return torch.nn.functional.linear(h, down_weight), (x, gate, up, h, act)


def gated_mlp_grads(grad_output, saved, weights, activation: str, nodes=(None, None, None)):
    """-> (grad_x, grad_gate_weight, grad_up_weight, grad_down_weight) for gated_mlp_forward's
    `saved` and the (gate, up, down) `weights`: the kernels where they read the tensors (weight
    gradients None where added into their .grad in place; `nodes`: the weights' accumulation
    nodes), else the reference."""
    x, gate = saved[0], saved[1]
    rows = (grad_output.contiguous(), *saved, *weights, activation)
    if not (x.is_cuda and kernels_read(x, gate, *weights)):
        return gated_mlp_backward_reference(*rows)
    into = [gradient_to_add_into(w, node) for w, node in zip(weights, nodes)]
    if any(g is not None for g in into):
        return gated_mlp_backward(*rows, into=into)
    return op("gated_mlp_backward")(*rows)


def kernels_read(x, gate, *weights) -> bool:
    """What the GEMM kernels take here: bf16 activations and weights, widths multiples of 8 (TMA's
    16-byte strides), some tokens."""
    return (all(t.dtype == torch.bfloat16 for t in (x, gate, *weights)) and x.shape[-1] % 8 == 0
            and gate.shape[-1] % 8 == 0 and x.numel() > 0)


def linear_backward(grad_y, x, weight, node):
    """(grad_x, grad_weight) of y = x . W^T over [..., in] rows: two GEMM-core products where they
    read the tensors (grad_weight None once added into weight.grad in place), else PyTorch's."""
    grad_y2, x2 = grad_y.reshape(-1, grad_y.shape[-1]), x.reshape(-1, x.shape[-1])
    if not (x.is_cuda and kernels_read(x2, grad_y2, weight)):
        return (grad_y2 @ weight).view(x.shape), (grad_y2.t() @ x2).to(weight.dtype)
    from .gemm import matmul_nt, weight_gradients

    grad_x = matmul_nt(grad_y2, weight.t())
    into = gradient_to_add_into(weight, node)
    (grad_weight,) = weight_gradients([grad_y2.t()], x2.t(), [into], [into is not None])
    return grad_x.view(x.shape), None if into is not None else grad_weight


def projections_backward(grads, x, weights, nodes):
    """(grad_x, grad_weight for each) of projections y_i = x . W_i^T sharing their input x [..., in]
    (a layer's Q, K and V): grad_x as one sum of products and the weight gradients as one group
    where the kernels read the tensors (each added into weight.grad in place where it may be, one
    product each then, returned as None), else PyTorch's."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = [g.reshape(x2.shape[0], -1) for g in grads]
    if not (x.is_cuda and kernels_read(x2, *rows, *weights)):
        grad_x = sum(g @ w for g, w in zip(rows, weights))
        return (grad_x.view(x.shape), *((g.t() @ x2).to(w.dtype) for g, w in zip(rows, weights)))
    from .gemm import matmul_nt_summed, weight_gradients

    grad_x = matmul_nt_summed([(g, w.t()) for g, w in zip(rows, weights)])
    into = [gradient_to_add_into(w, node) for w, node in zip(weights, nodes)]
    results = weight_gradients([g.t() for g in rows], x2.t(), into, [t is not None for t in into])
    return (grad_x.view(x.shape), *(None if t is not None else r for t, r in zip(into, results)))


def gelu_tanh_and_slope(gate32):
    """(gelu_tanh(x), its derivative) in fp32, the dgeglu epilogue's formula."""
    x2 = gate32 * gate32
    t = torch.tanh(GELU_TANH_K0 * gate32 * (1.0 + GELU_TANH_K1 * x2))
    half = 0.5 * (1.0 + t)
    return gate32 * half, half + 0.5 * gate32 * (1.0 - t * t) * GELU_TANH_K0 * (1.0 + 3.0 * GELU_TANH_K1 * x2)


def gated_mlp_backward(grad_output, x, gate, up, h, act, gate_weight, up_weight, down_weight, activation: str,
                       into=(None, None, None)):
    """-> (grad_x [..., H], grad_gate_weight, grad_up_weight [I, H], grad_down_weight [H, I]), bf16,
    by the four launches of the module docstring; grad_output, x [..., H], gate, up, h [..., I]
    bf16 with contiguous rows, act = silu(gate) for "silu" (None for "gelu_tanh"). `into`: per
    weight, a gradient to add its own into in place (the `add` epilogue), returned as None: the
    down projection's, and the gate's and up's together (two launches for the two, where the
    fresh pair is one)."""
    from .gemm import matmul_nt, matmul_nt_summed, weight_gradients

    g_y, x2, gate2, up2, h2 = (t.reshape(-1, t.shape[-1]) for t in (grad_output, x, gate, up, h))
    if activation == "silu":  # dswiglu's h = gate' * silu(up'): gate' = up, up' = gate
        g_up, g_gate = matmul_nt(g_y, down_weight.t(), epilogue="dswiglu",
                                 inputs=(up2, gate2, act.reshape(-1, act.shape[-1])))
    else:
        g_gate, g_up = matmul_nt(g_y, down_weight.t(), epilogue="dgeglu", inputs=(gate2, up2))
    into_gate, into_up, into_down = into
    adds_down = into_down is not None
    (grad_down_weight,) = weight_gradients([g_y.t()], h2.t(), [into_down], [adds_down])
    grad_x = matmul_nt_summed([(g_gate, gate_weight.t()), (g_up, up_weight.t())])
    adds_both = into_gate is not None and into_up is not None
    grad_gate_weight, grad_up_weight = weight_gradients([g_gate.t(), g_up.t()], x2.t(),
                                                        [into_gate, into_up] if adds_both else [None, None],
                                                        [adds_both] * 2)
    if adds_both:
        grad_gate_weight = grad_up_weight = None
    return grad_x.view(x.shape), grad_gate_weight, grad_up_weight, None if adds_down else grad_down_weight


def gated_mlp_backward_reference(grad_output, x, gate, up, h, act, gate_weight, up_weight, down_weight,
                                 activation: str):
    """The kernels' arithmetic in PyTorch: fp32 products, g_gate and g_up rounded to bf16 (as the
    epilogue stores them), each result rounded once to its tensor's dtype."""
    g_y, x2, gate2, up2, h2 = (t.reshape(-1, t.shape[-1]).float() for t in (grad_output, x, gate, up, h))
    g_h = g_y @ down_weight.float()
    if activation == "silu":
        sig = torch.sigmoid(gate2)
        slope, act2 = sig * (1.0 + gate2 * (1.0 - sig)), act.reshape(-1, act.shape[-1]).float()  # act as saved
    else:
        act2, slope = gelu_tanh_and_slope(gate2)
    g_gate, g_up = (g.to(torch.bfloat16).float() for g in (g_h * up2 * slope, g_h * act2))
    grad_x = g_gate @ gate_weight.float() + g_up @ up_weight.float()
    return (grad_x.to(x.dtype).view(x.shape), (g_gate.t() @ x2).to(gate_weight.dtype),
            (g_up.t() @ x2).to(up_weight.dtype), (g_y.t() @ h2).to(down_weight.dtype))


def gated_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor,
              activation: str) -> torch.Tensor:
    """The gated MLP on x [..., H] with bias-free weights gate, up [I, H] and down [H, I] and
    `activation` "gelu_tanh" or "silu" (module docstring)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: one of {ACTIVATIONS}, got {activation!r}")
    return _GatedMLPFunction.apply(x, gate_weight, up_weight, down_weight, activation)
