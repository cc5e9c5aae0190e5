"""A Llama-style decoder layer (Qwen3, Mistral, Llama) past its input norm as one autograd
function around the model's own attention, as gemma_layer.py does for Gemma3 (the reasons are
there: a backward bound by host time spends it node by node).

    llama_layer(residual, normed, cos, sin, attend, eps, qk_eps, activation, weights) -> output

The forward is transformers' layer op for op after `input_layernorm`: the Q/K/V projections
(Qwen3: Q/K norms over each head's d values before the transpose), RoPE, `attend` (the model's
attention from the rotated per-head Q, K and V to its output rows, as gemma_layer takes it),
o_proj and the residual add, post_attention_layernorm, the gated MLP (`activation` "silu") and
the second residual add. The backward: the MLP (gated_mlp's four products), the norm (the
RMSNorm row kernel), o_proj (two products), the attention's own small graph run backward
(PyTorch's attention backward), RoPE (one kernel), the Q/K norms (the row kernel over head
rows), the three projections (one sum of products for the input's gradient, one group for the
weights'). Weight gradients go into an accumulating `.grad` in place where
modules.gradient_to_add_into allows. On CPU tensors every step is the same arithmetic in PyTorch.
"""
from __future__ import annotations

import typing

import torch
import torch.nn.functional as F

from .gated_mlp import gated_mlp_forward, gated_mlp_grads, linear_backward, projections_backward
from .modules import norm_backward, rms_norm_forward, weight_nodes
from .rotary import rotary_backward, rotate


class LlamaLayerWeights(typing.NamedTuple):
    """A Llama-style decoder layer's parameters past its input norm, [out, in] as nn.Linear keeps
    them; q_norm and k_norm [head_dim] (Qwen3) or None."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_attn_ln: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class _LlamaLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, normed, cos, sin, attend, eps, qk_eps, activation, *weights):
        w = LlamaLayerWeights(*weights)
        batch, seq, _ = residual.shape
        head_dim = cos.shape[-1]

        def heads(weight, norm_weight):  # [b, heads, s, d] and what the head norm's backward reads
            rows = F.linear(normed, weight).view(batch, seq, -1, head_dim)
            if norm_weight is None:
                return rows.transpose(1, 2), (None, None)
            out, rstd, _ = rms_norm_forward(rows, norm_weight, qk_eps, False)
            return out.transpose(1, 2), (rows, rstd)

        query, q_saved = heads(w.q, w.q_norm)
        key, k_saved = heads(w.k, w.k_norm)
        value, _ = heads(w.v, None)
        query, key = rotate(query, key, cos.unsqueeze(1), sin.unsqueeze(1))
        with torch.enable_grad():  # the attention's own graph, which the backward runs backward
            leaves = tuple(t.detach().requires_grad_() for t in (query, key, value))
            attended = attend(*leaves)
        middle = residual + F.linear(attended, w.o)
        ffn_input, rstd, _ = rms_norm_forward(middle, w.post_attn_ln, eps, False)
        ffn_output, mlp_saved = gated_mlp_forward(ffn_input, w.gate, w.up, w.down, activation)
        ctx.save_for_backward(normed, cos, sin, *q_saved, *k_saved, middle, rstd, *mlp_saved, *w)
        ctx.attention = attended, leaves
        ctx.activation = activation
        return middle + ffn_output

    @staticmethod
    def backward(ctx, grad_output):
        normed, cos, sin, q_rows, q_rstd, k_rows, k_rstd, middle, rstd, *saved = ctx.saved_tensors
        mlp_saved, w = saved[:5], LlamaLayerWeights(*saved[5:])
        nodes = weight_nodes(ctx, w)
        grad_output = grad_output.contiguous()
        grad_ffn_input, grad_gate, grad_up, grad_down = gated_mlp_grads(
            grad_output, mlp_saved, (w.gate, w.up, w.down), ctx.activation, (nodes.gate, nodes.up, nodes.down))
        grad_middle, grad_post_attn = norm_backward(grad_ffn_input, middle, rstd, w.post_attn_ln, None,
                                                    nodes.post_attn_ln)
        grad_middle.add_(grad_output)  # the second residual add
        attended, leaves = ctx.attention
        grad_attended, grad_o = linear_backward(grad_middle, attended.detach(), w.o, nodes.o)
        grad_query, grad_key, grad_value = torch.autograd.grad(attended, leaves, grad_attended)
        # laid out [b, s, heads, d]: the projections' rows, read below without a copy
        grad_query, grad_key = rotary_backward(grad_query, grad_key, cos, sin, token_major=True)
        # back to the projections' [b, s, heads, d] rows, through the head norms where there are
        grad_query, grad_key, grad_value = (g.transpose(1, 2) for g in (grad_query, grad_key, grad_value))
        grad_q_norm = grad_k_norm = None
        if w.q_norm is not None:
            grad_query, grad_q_norm = norm_backward(grad_query, q_rows, q_rstd, w.q_norm, None, nodes.q_norm)
            grad_key, grad_k_norm = norm_backward(grad_key, k_rows, k_rstd, w.k_norm, None, nodes.k_norm)
        grad_normed, grad_q, grad_k, grad_v = projections_backward(
            (grad_query, grad_key, grad_value), normed, (w.q, w.k, w.v), (nodes.q, nodes.k, nodes.v))
        weight_grads = LlamaLayerWeights(grad_q, grad_k, grad_v, grad_q_norm, grad_k_norm, grad_o, grad_post_attn,
                                         grad_gate, grad_up, grad_down)
        return (grad_middle, grad_normed, None, None, None, None, None, None, *weight_grads)


def run(residual, normed, cos, sin, attend, eps: float, qk_eps: float | None, activation: str,
        weights: LlamaLayerWeights) -> torch.Tensor:
    """The layer's output for its input `residual` [b, s, H] and `normed` = input_layernorm(residual)
    (module docstring), bf16; cos and sin [b or 1, s, head_dim]; `eps` the post-attention norm's,
    `qk_eps` the Q/K norms' (None without them). Unchecked: the patched layer's call, whose
    modules cutebwd.patch checked."""
    return _LlamaLayerFunction.apply(residual, normed, cos, sin, attend, eps, qk_eps, activation, *weights)
