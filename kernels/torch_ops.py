"""The ops as PyTorch custom operators (`torch.ops.cutebwd.*`), so `torch.compile` traces
through them without graph breaks, and `ResidualRMSNorm`, an autograd module whose backward
is the fused residual RMSNorm backward.

Importing this module registers the operators. Their fake implementations give output shapes
and dtypes only, so tracing needs neither a GPU nor the DSL; the real ones call the ops of
kernels/ (the DSL is imported on the first real call). The operators are defined with
torch.library's low-level API: custom_op's Python layer measured ~65 us a call on the H200's
host inside a model's backward (12-40 standalone), where the op's own call costs ~30. Eagerly
even the dispatcher is skipped: the autograd functions' backwards call `op(name)`, the operator
while torch.compile traces and the Python function behind it otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch

_LIBRARY = "cutebwd"
_lib = torch.library.Library(_LIBRARY, "DEF")
_EAGER: dict = {}  # op name -> the function behind torch.ops.cutebwd.<name>


def _custom_op(name: str, mutates_args=()):
    """Defines torch.ops.cutebwd.<name> from the decorated function (the schema from its
    annotations, the function its implementation on every device) and keeps the function for
    `op`. torch.library's low-level API rather than custom_op, whose Python layer (argument
    and aliasing checks on every call) cost 12 us a call on the H200's host (torch.ops
    rmsnorm_backward 34 us a call against 22; the function alone 18-21)."""
    def register(function):
        _lib.define(name + torch.library.infer_schema(function, mutates_args=mutates_args))
        _lib.impl(name, function, "CompositeExplicitAutograd")
        _EAGER[name] = function
        return getattr(torch.ops.cutebwd, name)
    return register


def _fake(name: str):
    """Registers the decorated function as the op's fake implementation (shapes and dtypes)."""
    def register(fake):
        torch.library.register_fake(f"{_LIBRARY}::{name}", fake, lib=_lib)
        return fake
    return register


def op(name: str):
    """What a backward calls for the op `name`: its custom operator while torch.compile traces
    (dynamo traces operators, not our Python), else the function behind it, which skips the
    dispatcher's custom-op layer (a small model's backward is bound by host time)."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.cutebwd, name)
    return _EAGER[name]


@_custom_op("fused_residual_rmsnorm_backward")
def fused_residual_rmsnorm_backward(grad_output: torch.Tensor, x: Optional[torch.Tensor],
                                    normalized: Optional[torch.Tensor],
                                    rstd: torch.Tensor, weight: torch.Tensor
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused residual RMSNorm backward -> (grad_hidden_states, grad_residual, grad_weight);
    see the op in kernels/rmsnorm_backward.py."""
    from .rmsnorm_backward import fused_residual_rmsnorm_backward as run

    return run(grad_output, x, normalized, rstd, weight)


@_fake("fused_residual_rmsnorm_backward")
def _(grad_output, x, normalized, rstd, weight):
    return grad_output.new_empty(grad_output.shape), grad_output.new_empty(grad_output.shape), \
        weight.new_empty(weight.shape, dtype=torch.float32)


@_custom_op("rmsnorm_backward")
def rmsnorm_backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                     grad_weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's plain RMSNorm backward -> (grad_x bf16, grad_weight in grad_weight_dtype): grad, x
    bf16 [b, s, H], rstd fp32 [b, s, 1], weight [H]; weight and grad_weight bf16 or fp32; see
    rmsnorm_backward.rmsnorm_backward (the backward of kernels/modules.py's rms_norm, which
    checks its arguments)."""
    from .rmsnorm_backward import rmsnorm_backward as run

    grad_x, grad_weight = torch.empty_like(x), weight.new_empty(weight.shape, dtype=grad_weight_dtype)
    run(grad, x, rstd, weight, grad_x, grad_weight)
    return grad_x, grad_weight


@_fake("rmsnorm_backward")
def _(grad, x, rstd, weight, grad_weight_dtype):
    return x.new_empty(x.shape), weight.new_empty(weight.shape, dtype=grad_weight_dtype)


@_custom_op("embedding_rmsnorm_backward")
def embedding_rmsnorm_backward(grad_output: torch.Tensor, input_ids: torch.Tensor, hidden_states: torch.Tensor,
                               rstd: torch.Tensor, norm_weight: torch.Tensor, vocab_size: int = 65536
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding + RMSNorm backward, a fresh table -> (grad_embed_weight, grad_norm_weight);
    see kernels/embedding_backward.py."""
    from .embedding_backward import embedding_rmsnorm_backward as run

    return run(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size=vocab_size)


@_fake("embedding_rmsnorm_backward")
def _(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size=65536):
    hidden = grad_output.shape[-1]
    return grad_output.new_empty((vocab_size, hidden), dtype=torch.bfloat16), norm_weight.new_empty((hidden,))


@_custom_op("embedding_rmsnorm_backward_accumulate", mutates_args=("grad_embed_weight", "grad_norm_weight"))
def embedding_rmsnorm_backward_accumulate(grad_output: torch.Tensor, input_ids: torch.Tensor,
                                          hidden_states: torch.Tensor, rstd: torch.Tensor, norm_weight: torch.Tensor,
                                          grad_embed_weight: torch.Tensor, grad_norm_weight: torch.Tensor) -> None:
    """The embedding + RMSNorm backward adding this step's rows into grad_embed_weight (gradient
    accumulation); grad_norm_weight is overwritten with this step's. The vocabulary is the
    table's row count."""
    from .embedding_backward import embedding_rmsnorm_backward as run

    run(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size=grad_embed_weight.shape[0],
       out=(grad_embed_weight, grad_norm_weight), accumulate=True)


@_fake("embedding_rmsnorm_backward_accumulate")
def _(grad_output, input_ids, hidden_states, rstd, norm_weight, grad_embed_weight, grad_norm_weight):
    return None


@_custom_op("embedding_norm_backward")
def embedding_norm_backward(grad_normed: torch.Tensor, input_ids: torch.Tensor, embeds: torch.Tensor,
                            rstd: torch.Tensor, norm_weight: torch.Tensor, grad_embeds: torch.Tensor,
                            embed_scale: float, vocab: int, padding_idx: Optional[int] = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's embedding and first RMSNorm, backward, a fresh table -> (the table's gradient
    bf16, the norm weight's gradient fp32); see kernels/embedding_norm.py."""
    from .embedding_norm import fresh_table_gradient

    return fresh_table_gradient(grad_normed, input_ids, embeds, rstd, norm_weight, grad_embeds, embed_scale, vocab,
                                padding_idx)


@_fake("embedding_norm_backward")
def _(grad_normed, input_ids, embeds, rstd, norm_weight, grad_embeds, embed_scale, vocab, padding_idx=None):
    hidden = embeds.shape[-1]
    return embeds.new_empty((vocab, hidden)), norm_weight.new_empty((hidden,))


@_custom_op("qkv_qknorm_backward")
def qkv_qknorm_backward(grad_query: torch.Tensor, grad_key: torch.Tensor, grad_value: torch.Tensor,
                        hidden_states: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        v_weight: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                        query_transposed: Optional[torch.Tensor], key_transposed: Optional[torch.Tensor],
                        q_rstd: torch.Tensor,
                        k_rstd: torch.Tensor, q_normed: torch.Tensor, k_normed: torch.Tensor, rms_norm_eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The QKV projection with Q/K RMSNorm backward -> its six gradients; see
    kernels/qkv_qknorm_backward.py."""
    from .qkv_qknorm_backward import qkv_qknorm_backward as run

    return run(grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight, q_norm_weight,
              k_norm_weight, query_transposed, key_transposed, q_rstd, k_rstd, q_normed, k_normed, rms_norm_eps)


@_fake("qkv_qknorm_backward")
def _(grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight,
      query_transposed, key_transposed, q_rstd, k_rstd, q_normed, k_normed, rms_norm_eps):
    head_dim = grad_query.shape[-1]
    return (hidden_states.new_empty(hidden_states.shape), q_weight.new_empty(q_weight.shape),
            k_weight.new_empty(k_weight.shape), v_weight.new_empty(v_weight.shape),
            hidden_states.new_empty((head_dim,), dtype=torch.float32),
            hidden_states.new_empty((head_dim,), dtype=torch.float32))


@_custom_op("gated_mlp_backward")
def gated_mlp_backward(grad_output: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       h: torch.Tensor, act: Optional[torch.Tensor], gate_weight: torch.Tensor,
                       up_weight: torch.Tensor, down_weight: torch.Tensor, activation: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gated MLP's backward -> (grad_x, grad_gate_weight, grad_up_weight, grad_down_weight); see
    kernels/gated_mlp.py."""
    from .gated_mlp import gated_mlp_backward as run

    return run(grad_output, x, gate, up, h, act, gate_weight, up_weight, down_weight, activation)


@_fake("gated_mlp_backward")
def _(grad_output, x, gate, up, h, act, gate_weight, up_weight, down_weight, activation):
    return (x.new_empty(x.shape), gate_weight.new_empty(gate_weight.shape), up_weight.new_empty(up_weight.shape),
            down_weight.new_empty(down_weight.shape))


@_custom_op("rope_backward")
def rope_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's backward for queries and keys -> (dq, dk): kernels/rope_backward.py
    where the kernel reads the tensors (kernel_reads), else the same arithmetic in PyTorch."""
    from .rope_backward import kernel_reads, launch
    from .rotary import rope_backward_reference

    return (launch if kernel_reads(grad_q, grad_k, cos, sin) else rope_backward_reference)(grad_q, grad_k, cos, sin)


@_fake("rope_backward")
def _(grad_q, grad_k, cos, sin):
    return (grad_q.new_empty(grad_q.shape), grad_k.new_empty(grad_k.shape))


class _ResidualRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, residual, weight, eps):
        x = hidden_states.float() + residual.float()
        rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
        # normalized = x * rstd is recomputed by the kernel (normalized=None): 4 bytes per
        # element less saved and read.
        ctx.save_for_backward(x, rstd, weight)
        return (x * rstd * weight).to(hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, rstd, weight = ctx.saved_tensors
        # contiguous() is a no-op for the gradients autograd usually hands over; an expanded or
        # transposed one would be refused by the kernel
        grad_hidden_states, grad_residual, grad_weight = op("fused_residual_rmsnorm_backward")(
            grad_output.contiguous(), x, None, rstd, weight)
        return grad_hidden_states, grad_residual, grad_weight, None


class ResidualRMSNorm(torch.nn.Module):
    """y = bf16(weight * x * rsqrt(mean(x^2) + eps)) with x = hidden_states + residual in fp32
    (the fused residual RMSNorm forward, in PyTorch); the backward is the fused residual RMSNorm
    backward's kernel, giving hidden_states and residual the same gradient. bf16 hidden_states
    and residual of shape [b, s, H], an fp32 weight [H]."""

    def __init__(self, hidden: int, eps: float = 1e-6, device=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=torch.float32, device=device))

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16:
            raise ValueError(f"ResidualRMSNorm: hidden_states and residual must be bfloat16, got "
                             f"{hidden_states.dtype} and {residual.dtype}")
        if hidden_states.dim() != 3 or hidden_states.shape != residual.shape:
            raise ValueError(f"ResidualRMSNorm: hidden_states and residual must be [b, s, H] of one shape, got "
                             f"{tuple(hidden_states.shape)} and {tuple(residual.shape)}")
        return _ResidualRMSNormFunction.apply(hidden_states, residual, self.weight, self.eps)


@_custom_op("decoder_layer_backward")
def decoder_layer_backward(
        grad_output: torch.Tensor, residual: torch.Tensor, attn_input: torch.Tensor, query_states: torch.Tensor,
        key_states: torch.Tensor, value_states: torch.Tensor, query_states_rotated: torch.Tensor,
        key_states_rotated: torch.Tensor, key_states_repeated: torch.Tensor, value_states_repeated: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, attn_weights: torch.Tensor, attn_output: torch.Tensor,
        residual2: torch.Tensor, ffn_input: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, silu_up: torch.Tensor,
        swiglu_output: torch.Tensor, input_ln_weight: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
        v_weight: torch.Tensor, o_weight: torch.Tensor, post_attn_ln_weight: torch.Tensor, gate_weight: torch.Tensor,
        up_weight: torch.Tensor, down_weight: torch.Tensor, variance1: torch.Tensor, variance2: torch.Tensor,
        hidden_states_normalized1: torch.Tensor, hidden_states_normalized2: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder layer backward -> its ten gradients; see kernels/decoder_layer_backward.py."""
    from .decoder_layer_backward import decoder_layer_backward as run

    return run(grad_output, residual, attn_input, query_states, key_states, value_states, query_states_rotated,
              key_states_rotated, key_states_repeated, value_states_repeated, cos, sin, attn_weights, attn_output,
              residual2, ffn_input, gate, up, silu_up, swiglu_output, input_ln_weight, q_weight, k_weight, v_weight,
              o_weight, post_attn_ln_weight, gate_weight, up_weight, down_weight, variance1, variance2,
              hidden_states_normalized1, hidden_states_normalized2, eps)


@_fake("decoder_layer_backward")
def _(grad_output, residual, attn_input, query_states, key_states, value_states, query_states_rotated,
      key_states_rotated, key_states_repeated, value_states_repeated, cos, sin, attn_weights, attn_output, residual2,
      ffn_input, gate, up, silu_up, swiglu_output, input_ln_weight, q_weight, k_weight, v_weight, o_weight,
      post_attn_ln_weight, gate_weight, up_weight, down_weight, variance1, variance2, hidden_states_normalized1,
      hidden_states_normalized2, eps):
    from .decoder_layer_backward import INPUTS, _outputs

    named = locals()  # every input by its contract name
    return _outputs(None, {name: named[name] for name in INPUTS}, grad_output.shape[-1])
