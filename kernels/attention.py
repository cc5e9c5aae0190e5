"""The attention inside the layer functions (gemma_layer, llama_layer), forward and backward.

The layer's forward runs the model's own attention (`attend`: transformers' attention forward
after RoPE). Its backward is the attention's small graph run backward by a nested autograd
pass, or, where `attend` says the model's attention is sdpa's flash backend alone (causal, no
mask, no dropout: `attend.flash`), that backend's forward and backward ops called directly:
the same ops autograd would run, without the nested pass, its graph or its view nodes (a layer
backward is bound by host time). `attend.flash(query, key, value)` returns a FlashAttention, or
None where the model's attention would run anything else.
"""
from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

FLASH = int(SDPBackend.FLASH_ATTENTION)


class FlashAttention:
    """sdpa's flash attention of rotated per-head query [b, heads, s, d] and key, value
    [b, kv heads, s, d] (kv heads dividing heads: the backend shares them), causal, with no mask
    and no dropout, its forward op called directly and what its backward op reads kept."""

    def __init__(self, query, key, value, scale: float):
        self.query, self.key, self.value, self.scale = query, key, value, scale
        if query.is_cuda:
            (self.out, self.lse, self.cum_q, self.cum_k, self.max_q, self.max_k, self.seed, self.offset,
             _) = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False, scale=scale)
        else:
            self.out, self.lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, True, scale=scale)

    def rows(self):
        """The output as the model's attention hands it on: [b, s, heads * d] rows."""
        batch, heads, seq, dim = self.out.shape
        return self.out.transpose(1, 2).reshape(batch, seq, heads * dim).contiguous()

    def backward(self, grad_rows):
        """(grad_query, grad_key, grad_value) for the gradient of rows()."""
        batch, heads, seq, dim = self.out.shape
        grad_out = grad_rows.view(batch, seq, heads, dim).transpose(1, 2)
        if self.query.is_cuda:
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad_out, self.query, self.key, self.value, self.out, self.lse, self.cum_q, self.cum_k, self.max_q,
                self.max_k, 0.0, True, self.seed, self.offset, scale=self.scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, self.query, self.key, self.value, self.out, self.lse, 0.0, True, scale=self.scale)


def flash_applies(query, key, value, scale: float, gqa: bool) -> bool:
    """Whether sdpa itself would run these (causal, no mask, no dropout) through its flash
    backend as they are: more than one query row, head dims equal, at most 256 and a multiple of
    8 (sdpa pads others first), and its own backend choice."""
    dim = query.shape[-1]
    if query.shape[2] < 2 or key.shape[-1] != dim or value.shape[-1] != dim or dim > 256 or dim % 8:
        return False
    return torch._fused_sdp_choice(query, key, value, None, 0.0, True, scale=scale, enable_gqa=gqa) == FLASH


def attention_forward(attend, query, key, value):
    """(the attention's output rows, what attention_backward reads) for the rotated per-head
    query, key and value."""
    flash = getattr(attend, "flash", None)
    direct = flash(query, key, value) if flash is not None else None
    if direct is not None:
        return direct.rows(), direct
    with torch.enable_grad():  # the attention's own graph, which the backward runs backward
        leaves = tuple(t.detach().requires_grad_() for t in (query, key, value))
        return attend(*leaves), leaves


def attention_backward(attended, saved, grad_attended):
    """(grad_query, grad_key, grad_value) from attention_forward's results."""
    if isinstance(saved, FlashAttention):
        return saved.backward(grad_attended)
    return torch.autograd.grad(attended, saved, grad_attended)
