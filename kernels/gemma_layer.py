"""Gemma3's decoder layer past its input norm as one autograd function: a small model's backward
is bound by host time, and autograd's engine spends it node by node (the layer is ~30 nodes
eagerly: projections, views, transposes, norms, residual adds; here it is one).

    gemma_layer(residual, normed, cos, sin, attend, eps, qk_eps, q_heads, kv_heads, weights) -> output

The forward is transformers' Gemma3 layer op for op after `input_layernorm` (so its output is
bitwise the model's): Q/K/V projections with the Q/K norms, RoPE, the attention, o_proj,
post_attention_layernorm and the residual add, pre_feedforward_layernorm, the gelu_tanh MLP,
post_feedforward_layernorm and the second residual add. `attend(query, key, value)` is the
model's own attention from the rotated per-head Q, K and V ([b, heads, s, d]) to its output
rows [b, s, heads * d] (KV cache and attention implementation included); it runs with autograd
on, and the backward runs that small graph backward (PyTorch's attention backward: sdpa's,
flash's or eager's, as the model chose). Everything else runs backward through cutebwd's
kernels: the three norms (the RMSNorm row kernel), the MLP (gated_mlp's four products), o_proj
(two GEMM-core products), RoPE (one kernel) and the Q/K/V projections with the Q/K norms (the
QKV + Q/K-norm backward). Weight gradients go into an accumulating `.grad` in place where
modules.gradient_to_add_into allows (norms, MLP, o_proj); the Q/K/V weights' gradients are
handed to autograd. The residual's and `normed`'s gradients go back to the caller (the layer's
input norm, or embedding_norm for the first layer). On CPU tensors every step is the same
arithmetic in PyTorch.
"""
from __future__ import annotations

import typing

import torch
import torch.nn.functional as F

from .checks import check_module_tensors
from .gated_mlp import gated_mlp_forward, gated_mlp_grads, linear_backward
from .modules import norm_backward, qkv_norm_backward, qkv_norm_forward, rms_norm_forward, weight_nodes
from .rotary import rotary_backward, rotate


class GemmaLayerWeights(typing.NamedTuple):
    """A Gemma3 decoder layer's parameters past its input norm, [out, in] as nn.Linear keeps them."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_attn_ln: torch.Tensor
    pre_ff_ln: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    post_ff_ln: torch.Tensor


class _GemmaLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, normed, cos, sin, attend, eps, qk_eps, q_heads, kv_heads, *weights):
        w = GemmaLayerWeights(*weights)
        query, key, value, qkv_activations = qkv_norm_forward(normed, w.q, w.k, w.v, w.q_norm, w.k_norm, q_heads,
                                                              kv_heads, qk_eps)
        query, key = rotate(query, key, cos.unsqueeze(1), sin.unsqueeze(1))
        with torch.enable_grad():  # the attention's own graph, which the backward runs backward
            leaves = tuple(t.detach().requires_grad_() for t in (query, key, value))
            attended = attend(*leaves)
        projected = F.linear(attended, w.o)
        post_attn, rstd1, scale1 = rms_norm_forward(projected, w.post_attn_ln, eps, True)
        middle = residual + post_attn
        ffn_input, rstd2, scale2 = rms_norm_forward(middle, w.pre_ff_ln, eps, True)
        ffn_output, mlp_saved = gated_mlp_forward(ffn_input, w.gate, w.up, w.down, "gelu_tanh")
        post_ff, rstd3, scale3 = rms_norm_forward(ffn_output, w.post_ff_ln, eps, True)
        ctx.save_for_backward(cos, sin, *qkv_activations, projected, rstd1, scale1, middle, rstd2, scale2, *mlp_saved,
                              ffn_output, rstd3, scale3, *w)
        ctx.attention = attended, leaves
        ctx.qk_eps = qk_eps
        return middle + post_ff

    @staticmethod
    def backward(ctx, grad_output):
        cos, sin, *saved = ctx.saved_tensors
        qkv_activations, saved = saved[:5], saved[5:]
        (projected, rstd1, scale1, middle, rstd2, scale2, ffn_input, gate, up, h, act, ffn_output, rstd3,
         scale3) = saved[:14]
        w = GemmaLayerWeights(*saved[14:])
        nodes = weight_nodes(ctx, w)
        grad_output = grad_output.contiguous()
        grad_ffn_output, grad_post_ff = norm_backward(grad_output, ffn_output, rstd3, w.post_ff_ln, scale3,
                                                      nodes.post_ff_ln)
        grad_ffn_input, grad_gate, grad_up, grad_down = gated_mlp_grads(
            grad_ffn_output, (ffn_input, gate, up, h, act), (w.gate, w.up, w.down), "gelu_tanh",
            (nodes.gate, nodes.up, nodes.down))
        grad_middle, grad_pre_ff = norm_backward(grad_ffn_input, middle, rstd2, w.pre_ff_ln, scale2, nodes.pre_ff_ln)
        grad_middle.add_(grad_output)  # the second residual add
        grad_projected, grad_post_attn = norm_backward(grad_middle, projected, rstd1, w.post_attn_ln, scale1,
                                                       nodes.post_attn_ln)
        attended, leaves = ctx.attention
        grad_attended, grad_o = linear_backward(grad_projected, attended.detach(), w.o, nodes.o)
        grad_query, grad_key, grad_value = torch.autograd.grad(attended, leaves, grad_attended)
        grad_query, grad_key = rotary_backward(grad_query, grad_key, cos, sin)
        grad_normed, grad_q, grad_k, grad_v, grad_q_norm, grad_k_norm = qkv_norm_backward(
            grad_query, grad_key, grad_value, qkv_activations, (w.q, w.k, w.v, w.q_norm, w.k_norm), ctx.qk_eps,
            (nodes.q_norm, nodes.k_norm))
        weight_grads = GemmaLayerWeights(grad_q, grad_k, grad_v, grad_q_norm, grad_k_norm, grad_o, grad_post_attn,
                                         grad_pre_ff, grad_gate, grad_up, grad_down, grad_post_ff)
        return (grad_middle, grad_normed, None, None, None, None, None, None, None, *weight_grads)


def gemma_layer(residual: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend,
                eps: float, qk_eps: float, q_heads: int, kv_heads: int, weights: GemmaLayerWeights) -> torch.Tensor:
    """The layer's output for its input `residual` [b, s, H] and `normed` = input_layernorm(residual)
    (module docstring): bf16 tensors and parameters, one kv head (the QKV backward's), cos and
    sin [b or 1, s, head_dim] the model's rotary tables for this layer, `eps` the layer norms' and
    `qk_eps` the Q/K norms'. Other dtypes, shapes and widths raise TypeError / ValueError naming
    the argument."""
    weights = GemmaLayerWeights(*weights)
    _check_arguments(residual, normed, cos, sin, attend, q_heads, kv_heads, weights)
    return run(residual, normed, cos, sin, attend, eps, qk_eps, q_heads, kv_heads, weights)


def run(residual, normed, cos, sin, attend, eps: float, qk_eps: float, q_heads: int, kv_heads: int,
        weights: GemmaLayerWeights) -> torch.Tensor:
    """gemma_layer without its argument checks: the patched layer's call, whose modules the patch
    checked and whose activations the model made (a small model's step is bound by host time)."""
    return _GemmaLayerFunction.apply(residual, normed, cos, sin, attend, eps, qk_eps, q_heads, kv_heads, *weights)


def _check_arguments(residual, normed, cos, sin, attend, q_heads: int, kv_heads: int, weights: GemmaLayerWeights):
    """TypeError / ValueError naming the argument, before the forward runs."""
    from .qkv_qknorm_backward import MAX_HEAD_DIM, VECTOR

    tensors = {"residual": residual, "normed": normed, "cos": cos, "sin": sin,
               **{f"weights.{name}": t for name, t in weights._asdict().items()}}
    check_module_tensors("gemma_layer", tensors, "residual")
    if not callable(attend):
        raise TypeError(f"gemma_layer: attend: expected a callable, got {type(attend).__name__}")
    if residual.dim() != 3 or normed.shape != residual.shape:
        raise ValueError(f"gemma_layer: residual and normed: expected one [b, s, H] shape, got "
                         f"{tuple(residual.shape)} and {tuple(normed.shape)}")
    batch, seq, hidden = residual.shape
    head_dim = weights.q_norm.shape[0] if weights.q_norm.dim() == 1 else -1
    if kv_heads != 1 or q_heads < 1:
        raise ValueError(f"gemma_layer: the QKV backward reads one kv head, got {q_heads} query and {kv_heads} kv "
                         f"heads")
    if head_dim % VECTOR or not 0 < head_dim <= MAX_HEAD_DIM or hidden % 8:
        raise ValueError(f"gemma_layer: head_dim must be a multiple of {VECTOR} up to {MAX_HEAD_DIM} and the hidden "
                         f"size a multiple of 8, got {head_dim} and {hidden}")
    if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[0] not in (1, batch) or cos.shape[1:] != (seq, head_dim):
        raise ValueError(f"gemma_layer: cos and sin: expected [1 or {batch}, {seq}, {head_dim}], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    intermediate = weights.gate.shape[0] if weights.gate.dim() == 2 else -1
    q_width = q_heads * head_dim
    want = GemmaLayerWeights((q_width, hidden), (head_dim, hidden), (head_dim, hidden), (head_dim,), (head_dim,),
                             (hidden, q_width), (hidden,), (hidden,), (intermediate, hidden), (intermediate, hidden),
                             (hidden, intermediate), (hidden,))
    for name, t, shape in zip(GemmaLayerWeights._fields, weights, want):
        if tuple(t.shape) != shape:
            raise ValueError(f"gemma_layer: weights.{name}: expected {list(shape)}, got {list(t.shape)}")
