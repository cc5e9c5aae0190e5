"""A model's embedding lookup and first RMSNorm as one autograd function whose backward is the
embedding backward's model form (embedding_backward.embedding_norm_backward).

    embedding_norm(input_ids, weight, norm_weight, eps, one_plus=False, embed_scale=None, padding_idx=None)
        -> (embeds, normed): embeds = weight[input_ids] (times Gemma's embed_scale, rounded to the
        weight's dtype as transformers does), normed = the first layer's RMSNorm of embeds as
        transformers computes it (kernels/modules.py rms_norm). The residual branch carries
        embeds on, the layer's attention reads normed; the backward gets both gradients and
        writes the table's gradient in one pass, each row rounded once. The row `padding_idx`
        gets no gradient, as in torch.nn.Embedding.

The table's gradient: where `weight.grad` already holds one (gradient accumulation over micro
batches, or a tied output projection whose gradient came first) the backward adds into it in
place (accumulate=True: only the rows the ids name are read and written) and hands autograd
nothing for the table (modules.gradient_to_add_into: eager, a pass that accumulates, no
create_graph); otherwise it writes a fresh table and hands that to autograd (under torch.compile
through torch.ops.cutebwd.embedding_norm_backward). On CPU tensors and shapes the kernels do not
take, the backward is the same arithmetic in PyTorch.
"""
from __future__ import annotations

import torch

from ..references.rmsnorm import normalized_dx
from .modules import accumulation_nodes, gradient_to_add_into, hand_over, kernel_reads, kernel_weight, rms_norm_forward
from .torch_ops import op


class _EmbeddingNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_ids, weight, norm_weight, eps, one_plus, embed_scale, padding_idx):
        # transformers' own sequence of operations, so the outputs are bitwise the model's
        # transformers multiplies by the scale as a tensor of the weight's dtype: the same
        # product as a Python number rounded to that dtype, which needs no host-to-device copy
        scale = 1.0 if embed_scale is None else _rounded(embed_scale, weight.dtype)
        embeds = torch.nn.functional.embedding(input_ids, weight)
        if embed_scale is not None:
            embeds = embeds * scale
        normed, rstd, norm_scale = rms_norm_forward(embeds, norm_weight, eps, one_plus)
        ctx.save_for_backward(input_ids, weight, embeds, rstd, norm_weight, norm_scale)
        ctx.padding_idx, ctx.embed_scale = padding_idx, scale
        return embeds, normed

    @staticmethod
    def backward(ctx, grad_embeds, grad_normed):
        input_ids, weight, embeds, rstd, norm_weight, norm_scale = ctx.saved_tensors
        if grad_normed is None:
            grad_normed = torch.zeros_like(embeds)
        if grad_embeds is None:
            grad_embeds = torch.zeros_like(embeds)
        # the norm weight's gradient comes in this weight's dtype
        scale = kernel_weight(norm_weight, norm_scale)
        rows = (grad_normed.contiguous(), input_ids, embeds, rstd, scale, grad_embeds.contiguous(), ctx.embed_scale)
        table_node, norm_node = accumulation_nodes(ctx, 1, 2)
        into = gradient_to_add_into(weight, table_node)
        if into is not None:
            grad_norm_weight = _add_table_gradient(into, *rows, ctx.padding_idx)
            table = None
        else:
            table, grad_norm_weight = op("embedding_norm_backward")(*rows, weight.shape[0], ctx.padding_idx)
        return None, table, hand_over(norm_weight, grad_norm_weight, norm_node), None, None, None, None


@torch.compiler.assume_constant_result  # a number, not a tensor, in a compiled graph
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`, as a Python number."""
    return float(torch.tensor(value, dtype=dtype))


def fresh_table_gradient(grad_normed, input_ids, embeds, rstd, scale, grad_embeds, embed_scale: float, vocab: int,
                         padding_idx=None):
    """(the table's gradient bf16 [vocab, H], the norm weight's fp32): the kernel where it reads
    the rows, its arithmetic in PyTorch elsewhere (torch.ops.cutebwd.embedding_norm_backward)."""
    if embeds.is_cuda and kernel_reads(embeds, grad_normed, grad_embeds):
        from .embedding_backward import embedding_norm_backward

        table = embeds.new_empty((vocab, embeds.shape[-1]))
        grad_norm_weight = torch.empty_like(scale)
        embedding_norm_backward(grad_normed, input_ids, embeds, rstd, scale, grad_embeds, embed_scale, table,
                                grad_norm_weight, accumulate=False, poison=True, padding_idx=padding_idx)
        return table, grad_norm_weight
    fresh, grad_norm_weight = embedding_norm_backward_reference(grad_normed, input_ids, embeds, rstd, scale,
                                                                grad_embeds, embed_scale, vocab, padding_idx)
    return fresh.to(embeds.dtype), grad_norm_weight.to(scale.dtype)


def _add_table_gradient(table, grad_normed, input_ids, embeds, rstd, scale, grad_embeds, embed_scale: float,
                        padding_idx):
    """Adds the table's gradient into `table` in place (only the rows the ids name are read and
    written); -> the norm weight's gradient (fp32)."""
    if embeds.is_cuda and kernel_reads(embeds, grad_normed, grad_embeds):
        from .embedding_backward import embedding_norm_backward

        grad_norm_weight = torch.empty_like(scale)
        embedding_norm_backward(grad_normed, input_ids, embeds, rstd, scale, grad_embeds, embed_scale, table,
                                grad_norm_weight, accumulate=True, poison=False, padding_idx=padding_idx)
        return grad_norm_weight
    fresh, grad_norm_weight = embedding_norm_backward_reference(grad_normed, input_ids, embeds, rstd, scale,
                                                                grad_embeds, embed_scale, table.shape[0], padding_idx)
    table.copy_(table.float() + fresh)
    return grad_norm_weight


def embedding_norm_backward_reference(grad_normed, input_ids, embeds, rstd, scale, grad_embeds, embed_scale: float,
                                      vocab: int, padding_idx=None):
    """The kernel's arithmetic in PyTorch: (the table's gradient in fp32, grad of the norm's
    weight in fp32), fp32 throughout; no gradient for the row `padding_idx`."""
    hidden = embeds.shape[-1]
    g, normalized = grad_normed.float(), embeds.float() * rstd
    rows = (normalized_dx(g * scale, normalized, rstd) + grad_embeds.float()) * embed_scale
    if padding_idx is not None:
        rows = rows.masked_fill((input_ids == padding_idx).unsqueeze(-1), 0.0)
    table = torch.zeros(vocab, hidden, dtype=torch.float32, device=embeds.device)
    table.index_add_(0, input_ids.reshape(-1), rows.reshape(-1, hidden))
    return table, (g * normalized).reshape(-1, hidden).sum(0)


def embedding_norm(input_ids: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   one_plus: bool = False, embed_scale: float | None = None, padding_idx: int | None = None):
    """(embeds, normed) of the model's embedding and first RMSNorm (module docstring)."""
    return _EmbeddingNormFunction.apply(input_ids, weight, norm_weight, eps, one_plus, embed_scale, padding_idx)
