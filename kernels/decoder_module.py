"""A Llama-style decoder layer (pre-norm GQA attention with RoPE, SwiGLU FFN) as one autograd
function: the forward is transformers' eager computation, op for op (so its output is bitwise
the model's), saving what the decoder layer backward reads; the backward is that op, the whole
layer in one host call.

    decoder_layer(hidden_states, weights, attention_mask, cos, sin, eps, q_heads, kv_heads)

Real models apply silu to the gate (`silu(gate) * up`); the backward's contract applies it to
`up`. The two forms are one formula with the roles exchanged, so the model's gate goes in as the
contract's `up` (with its weight) and the model's up as the contract's `gate`, and their weight
gradients come back exchanged too.

On CPU tensors the backward is the contract's PyTorch reference (the same formula in bf16 as
written), so a model's wiring can be checked without a GPU.
"""
from __future__ import annotations

import typing

import torch
import torch.nn.functional as F

from ..references import decoder_layer as contract
from .checks import check_module_tensors
from .modules import gradient_to_add_into, hand_over, weight_nodes
from .torch_ops import op


class LayerWeights(typing.NamedTuple):
    """A decoder layer's parameters, [out, in] as nn.Linear keeps them."""
    input_ln: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_attn_ln: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def rms_norm_saving(x, weight, eps):
    """transformers' Llama-style RMSNorm, weight * bf16(x * rstd) -> (output, variance, fp32 x * rstd)."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    normalized = x32 * torch.rsqrt(variance + eps)
    return weight * normalized.to(x.dtype), variance, normalized


def repeat_kv(t, group: int):
    """[b, kv_heads, s, d] -> [b, kv_heads * group, s, d], query head h reading kv head h // group."""
    if group == 1:
        return t
    batch, kv_heads, seq, head_dim = t.shape
    return t[:, :, None].expand(batch, kv_heads, group, seq, head_dim).reshape(batch, kv_heads * group, seq, head_dim)


class _DecoderLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, attention_mask, cos, sin, eps, q_heads, kv_heads, *weights):
        w = LayerWeights(*weights)
        batch, seq, _ = hidden_states.shape
        head_dim = cos.shape[-1]
        residual = hidden_states
        attn_input, variance1, normalized1 = rms_norm_saving(residual, w.input_ln, eps)

        def heads(weight):  # [b, heads, s, d], a view of the projection's [b, s, heads, d]
            return F.linear(attn_input, weight).view(batch, seq, -1, head_dim).transpose(1, 2)

        query, key, value = heads(w.q), heads(w.k), heads(w.v)
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)
        query_rotated = query * cos_h + contract.rotate_half(query) * sin_h
        key_rotated = key * cos_h + contract.rotate_half(key) * sin_h
        group = q_heads // kv_heads
        key_repeated, value_repeated = repeat_kv(key_rotated, group), repeat_kv(value, group)
        scores = torch.matmul(query_rotated, key_repeated.transpose(2, 3)) * head_dim ** -0.5
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        del scores
        attn_output = torch.matmul(probs, value_repeated).transpose(1, 2).contiguous().reshape(batch, seq, -1)
        residual2 = residual + F.linear(attn_output, w.o)
        ffn_input, variance2, normalized2 = rms_norm_saving(residual2, w.post_attn_ln, eps)
        gate, up = F.linear(ffn_input, w.gate), F.linear(ffn_input, w.up)
        silu_gate = F.silu(gate)
        swiglu_output = silu_gate * up
        output = residual2 + F.linear(swiglu_output, w.down)
        # The op reads cos and sin as [b, s, d] rows; a model shares one table across the batch.
        cos, sin = (t.expand(batch, -1, -1).contiguous() for t in (cos, sin))
        ctx.save_for_backward(residual, attn_input, query_rotated, key_rotated, key_repeated, value_repeated, cos,
                              sin, probs, attn_output, residual2, ffn_input, gate, up, silu_gate, swiglu_output,
                              variance1, variance2, normalized1, normalized2, *w)
        ctx.eps = eps
        ctx.mark_non_differentiable(key_rotated, value)
        return output, key_rotated, value

    @staticmethod
    def backward(ctx, grad_output, _grad_key, _grad_value):
        (residual, attn_input, query_rotated, key_rotated, key_repeated, value_repeated, cos, sin, probs, attn_output,
         residual2, ffn_input, gate, up, silu_gate, swiglu_output, variance1, variance2, normalized1,
         normalized2, *weights) = ctx.saved_tensors
        w = LayerWeights(*weights)
        # The contract's pre-RoPE q/k/v and its un-repeated rotated k are not read by its math:
        # the rotated query and keys stand in for them. Gate and up exchanged: the module docstring.
        args = (grad_output.contiguous(), residual, attn_input, query_rotated, key_rotated, key_rotated,
                query_rotated, key_rotated, key_repeated, value_repeated, cos, sin, probs, attn_output, residual2,
                ffn_input, up, gate, silu_gate, swiglu_output, w.input_ln, w.q, w.k, w.v, w.o, w.post_attn_ln,
                w.up, w.gate, w.down, variance1, variance2, normalized1, normalized2, ctx.eps)
        # The projections' gradients go into an accumulating .grad in place (gradient_to_add_into),
        # in the contract's names: its gate is the model's up and its up the model's gate.
        nodes = weight_nodes(ctx, w)  # counted from the last (attention_mask may be None)
        into = {name: grad for name, weight, node in (("grad_q_weight", w.q, nodes.q), ("grad_k_weight", w.k, nodes.k),
                                                       ("grad_v_weight", w.v, nodes.v), ("grad_o_weight", w.o, nodes.o),
                                                       ("grad_gate_weight", w.up, nodes.up),
                                                       ("grad_up_weight", w.gate, nodes.gate),
                                                       ("grad_down_weight", w.down, nodes.down))
                if (grad := gradient_to_add_into(weight, node)) is not None} if grad_output.is_cuda else {}
        if into:
            from .decoder_layer_backward import decoder_layer_backward

            grads = decoder_layer_backward(*args, add_into=into)
        elif grad_output.is_cuda:
            grads = op("decoder_layer_backward")(*args)
        else:
            grads = contract.decoder_layer_backward(*args)
        grads = [None if any(g is t for t in into.values()) else g for g in grads]
        (grad_input, grad_input_ln, grad_q, grad_k, grad_v, grad_o, grad_post_attn_ln, grad_up, grad_gate,
         grad_down) = grads
        weight_grads = (hand_over(w.input_ln, grad_input_ln, nodes.input_ln), grad_q, grad_k, grad_v, grad_o,
                        hand_over(w.post_attn_ln, grad_post_attn_ln, nodes.post_attn_ln), grad_gate, grad_up,
                        grad_down)
        return (grad_input, None, None, None, None, None, None, *weight_grads)


def decoder_layer(hidden_states: torch.Tensor, weights: LayerWeights, attention_mask: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor, eps: float, q_heads: int, kv_heads: int):
    """-> (output, key_states, value_states): the layer's output for hidden_states [b, s, H]
    (bf16) as transformers' eager Llama / Mistral layer computes it, and the rotated keys and the
    values [b, kv_heads, s, d] for a KV cache (not differentiable). `attention_mask` additive,
    broadcast to [b, heads, s, s] (or None); cos and sin [b or 1, s, head_dim], the model's
    rotary tables. The backward is decoder_layer_backward, which reads head_dim a multiple of 32
    and widths a multiple of 8; other dtypes, shapes and widths raise TypeError / ValueError
    naming the argument."""
    weights = LayerWeights(*weights)
    _check_arguments(hidden_states, weights, cos, sin, q_heads, kv_heads)
    return _DecoderLayerFunction.apply(hidden_states, attention_mask, cos, sin, eps, q_heads, kv_heads, *weights)


def _check_arguments(hidden_states, weights: LayerWeights, cos, sin, q_heads: int, kv_heads: int):
    """TypeError / ValueError naming the argument, before the forward runs (a layer's forward
    takes milliseconds; these checks take microseconds)."""
    tensors = {"hidden_states": hidden_states, "cos": cos, "sin": sin,
               **{f"weights.{name}": t for name, t in weights._asdict().items()}}
    check_module_tensors("decoder_layer", tensors, "hidden_states")
    if hidden_states.dim() != 3:
        raise ValueError(f"decoder_layer: hidden_states: expected [b, s, H], got {tuple(hidden_states.shape)}")
    batch, seq, hidden = hidden_states.shape
    head_dim = cos.shape[-1]
    if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
        raise ValueError(f"decoder_layer: cos and sin: expected [1 or {batch}, {seq}, head_dim], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if weights.gate.dim() != 2:
        raise ValueError(f"decoder_layer: weights.gate: expected [intermediate, {hidden}], got "
                         f"{list(weights.gate.shape)}")
    intermediate = weights.gate.shape[0]
    why = check_layer(hidden, intermediate, head_dim, q_heads, kv_heads)
    if why:
        raise ValueError(f"decoder_layer: {why}")
    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
    want = LayerWeights((hidden,), (q_width, hidden), (kv_width, hidden), (kv_width, hidden), (hidden, q_width),
                        (hidden,), (intermediate, hidden), (intermediate, hidden), (hidden, intermediate))
    for name, t, shape in zip(LayerWeights._fields, weights, want):
        if tuple(t.shape) != shape:
            raise ValueError(f"decoder_layer: weights.{name}: expected {list(shape)}, got {list(t.shape)}")


def check_layer(hidden: int, intermediate: int, head_dim: int, q_heads: int, kv_heads: int) -> str | None:
    """Why the decoder layer backward does not read a layer of these widths, or None."""
    if head_dim % 32 or not head_dim:
        return f"head_dim {head_dim} is not a multiple of 32 (the inverse RoPE's tiles)"
    if hidden % 8 or intermediate % 8:
        return f"hidden {hidden} and intermediate {intermediate} must be multiples of 8"
    if not kv_heads or q_heads % kv_heads:
        return f"{q_heads} query heads are not a multiple of {kv_heads} kv heads"
    return None
