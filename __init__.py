"""cutebwd: backward-pass GPU kernels in the CUTLASS CuTe DSL for four SOL-ExecBench problems.

Public ops are attributes of this package, imported on first use (the DSL takes a moment to
import, and `cutebwd.references` needs none of it):

    cutebwd.rms_rstd(x, eps=1e-6, *, out=None)     row rsqrt(mean(x^2) + eps), fp32
    cutebwd.fused_residual_rmsnorm_backward(grad_output, x, normalized, rstd, weight, *, out=None)
    cutebwd.embedding_rmsnorm_backward(grad_output, input_ids, hidden_states, rstd, norm_weight, *,
                                       vocab_size=65536, out=None, accumulate=False, check_ids="deferred")

    cutebwd.qkv_qknorm_backward(grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight,
                                q_norm_weight, k_norm_weight, query_transposed, key_transposed, q_rstd,
                                k_rstd, q_normed, k_normed, rms_norm_eps=1e-6, *, out=None)
    cutebwd.decoder_layer_backward(grad_output, residual, attn_input, ..., hidden_states_normalized2, eps,
                                   *, out=None)   the 34 inputs of semantics.md's L2/056, in order
    cutebwd.ResidualRMSNorm(hidden, eps=1e-6)     autograd module, 013's kernel as its backward
    cutebwd.GemmaQKVNorm(q_proj, k_proj, v_proj, q_norm, k_norm, q_heads, kv_heads)
                                                  autograd module over Gemma3 attention's layers,
                                                  051's kernel as its backward
    cutebwd.decoder_layer(hidden_states, weights, attention_mask, cos, sin, eps, q_heads, kv_heads)
                                                  a Llama / Mistral decoder layer as one autograd
                                                  function (transformers' eager forward), the decoder
                                                  layer backward as its backward; weights a LayerWeights
    cutebwd.gemma_layer(residual, normed, cos, sin, attend, eps, qk_eps, q_heads, kv_heads, weights)
                                                  a Gemma3 decoder layer past its input norm as one
                                                  autograd function around the model's own attention;
                                                  weights a GemmaLayerWeights
    cutebwd.embedding_norm(input_ids, weight, norm_weight, eps, one_plus=False, embed_scale=None, padding_idx=None)
                                                  a model's token embedding and first RMSNorm as one
                                                  autograd function, 087's row kernel (model form) as
                                                  its backward
    cutebwd.patch(model, decoder_layers=False)    a transformers model's layers onto these backwards,
                                                  in place (kernels/hf_patch.py: Gemma3, Qwen3, Mistral,
                                                  Llama)
    cutebwd.check_errors(device=None)             synchronizes and raises an error the device recorded
                                                  (out-of-range ids of a deferred check)

`import cutebwd.kernels.torch_ops` registers the ops as torch.ops.cutebwd.* custom operators
(torch.compile traces through them; kernels/torch_ops.py).

Subpackages: kernels (device code), layouts (tiling), references (plain PyTorch, the
contract), tools (audit, bench, parity, timing).
"""
# private names: dir(cutebwd) lists the ops and the subpackages, nothing borrowed
import importlib as _importlib
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("cutebwd")
except _metadata.PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"

# public op -> module that defines it
_OPS = {
    "rms_rstd": "cutebwd.kernels.row_rstd",
    "fused_residual_rmsnorm_backward": "cutebwd.kernels.rmsnorm_backward",
    "embedding_rmsnorm_backward": "cutebwd.kernels.embedding_backward",
    "qkv_qknorm_backward": "cutebwd.kernels.qkv_qknorm_backward",
    "decoder_layer_backward": "cutebwd.kernels.decoder_layer_backward",
    "ResidualRMSNorm": "cutebwd.kernels.torch_ops",
    "GemmaQKVNorm": "cutebwd.kernels.modules",
    "decoder_layer": "cutebwd.kernels.decoder_module",
    "LayerWeights": "cutebwd.kernels.decoder_module",
    "gemma_layer": "cutebwd.kernels.gemma_layer",
    "GemmaLayerWeights": "cutebwd.kernels.gemma_layer",
    "embedding_norm": "cutebwd.kernels.embedding_norm",
    "patch": "cutebwd.kernels.hf_patch",
    "check_errors": "cutebwd.kernels.errors",
}

__all__ = sorted(_OPS)


def __dir__():
    return sorted({*globals(), *_OPS})


def __getattr__(name):
    if name in _OPS:
        return getattr(_importlib.import_module(_OPS[name]), name)
    raise AttributeError(f"module 'cutebwd' has no attribute {name!r}")
