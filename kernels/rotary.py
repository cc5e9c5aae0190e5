"""transformers' apply_rotary_pos_emb as one autograd function whose backward is one kernel
(kernels/rope_backward.py) for queries and keys together.

    apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed)
        the forward is transformers' own operations (bitwise its output); q, k [b, heads, s, d],
        cos, sin [b or 1, s, d]. It saves cos and sin only.

On CUDA bf16 tensors the backward is the kernel where it reads the tensors' shapes, strides and
alignment (rope_backward.kernel_reads; under torch.compile the operator
torch.ops.cutebwd.rope_backward, which decides the same), else the same arithmetic in PyTorch
(rope_backward_reference), fp32 with one rounding, as everywhere else. Calls this function does not cover (another
unsqueeze_dim, cos or sin needing a gradient) run transformers' operations with autograd's
backward.
"""
from __future__ import annotations

import torch

from ..references.decoder_layer import rotate_half
from .torch_ops import op


def rotate(q, k, cos, sin):
    """transformers' operations, op for op."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(q, k, cos.unsqueeze(1), sin.unsqueeze(1))

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        return (*rotary_backward(grad_q, grad_k, *ctx.saved_tensors), None, None)


def rotary_backward(grad_q, grad_k, cos, sin, token_major: bool = False):
    """(grad_q, grad_k) through apply_rotary_pos_emb's forward: the kernel where it reads the
    tensors, else rope_backward_reference. token_major: the kernel's results laid out [b, s,
    heads, d] in memory (still indexed [b, heads, s, d]), so a caller going back to the
    projections' rows reads them without a copy; eager calls only."""
    if grad_q is not None and grad_k is not None and grad_q.is_cuda:
        from . import rope_backward

        if torch.compiler.is_compiling():  # strides and alignment: the operator's call
            if rope_backward.kernel_takes(grad_q, grad_k, cos, sin):
                return op("rope_backward")(grad_q, grad_k, cos, sin)
        elif rope_backward.kernel_reads(grad_q, grad_k, cos, sin):
            return rope_backward.launch(grad_q, grad_k, cos, sin, token_major)
    return rope_backward_reference(grad_q, grad_k, cos, sin)


def rope_backward_reference(grad_q, grad_k, cos, sin):
    """The kernel's arithmetic in PyTorch: g_x1 = g1 cos1 + g2 sin2, g_x2 = g2 cos2 - g1 sin1 in
    fp32, rounded once; a missing gradient stays None."""
    c1, c2 = cos.unsqueeze(1).float().chunk(2, dim=-1)
    s1, s2 = sin.unsqueeze(1).float().chunk(2, dim=-1)

    def back(g):
        if g is None:
            return None
        g1, g2 = g.float().chunk(2, dim=-1)
        return torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), dim=-1).to(g.dtype)

    return back(grad_q), back(grad_k)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb (module docstring)."""
    if unsqueeze_dim != 1 or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)):
        return rotate(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
    return _RotaryFunction.apply(q, k, cos, sin)
