"""The decoder layer backward: the whole layer through the GEMM core.

Fourteen steps from one host call (docs/design-decoder-layer.md), comments name the contract's
lines; T = batch * seq tokens, H hidden, I intermediate, d head_dim:

    step  what                                                               how
    1     g_sw = go . Wd -> g_gate, g_up (bf16 [T, I]; g_sw never stored)    dswiglu epilogue
    2     grad_down_weight = go^T . swiglu_output                            plain product
    3     g_ffn = g_gate . Wg + g_up . Wu (fp32 [T, H])                      summed product
    4     grad_gate_weight, grad_up_weight = [g_gate; g_up]^T . ffn_input    grouped product
    5     g_attn = bf16(go + rms_dx(g_ffn * w2, residual2, rstd2)) and       the RMSNorm row kernel
          grad_post_attn_ln_weight                                           in DECODER_FORM
    6     pv = P . v_rep per (batch, head), into [T, heads * d] rows         batched
          g_ao = g_attn . Wo, D = rowsum(g_ao * pv) per (token, head)        row_dot epilogue
    7     grad_o_weight = g_attn^T . attn_output                             plain
    8     g_s = P * (g_ao . v_rep^T - D) / sqrt(d) per (batch, head)         batched, softmax_bwd
    9     dq = inverse RoPE of g_s . k_rep, into dq's head view              batched, rope_inverse
    10    dk = inverse RoPE of the groups' sums of g_s^T . q_rot             batched sums over each
                                                                             kv head's query heads,
                                                                             rope_inverse
    11    dv = the groups' sums of P^T . g_ao                                batched sums
    12    g_ai = dq . Wq + dk . Wk + dv . Wv (fp32 [T, H])                   summed
    13    grad_q/k/v_weight = [dq; dk; dv]^T . attn_input                    grouped
    14    grad_input = bf16(g_attn + rms_dx(g_ai * w1, residual, rstd1)) and row kernel
          grad_input_ln_weight

They run in the order 1-7, 11, 8-10, 12-14, so the [b, heads, s, s] tensors live as briefly as
they can: the device memory a call takes beyond its inputs and outputs stays within 110% of the
outputs' size (tests/test_decoder_layer.py).

D is the contract's rowsum(P * g_p) per score row, which equals rowsum(g_ao * (P . v)) per
(token, head) because g_p = g_ao . v^T: one more batched product (as cheap as g_p's) instead of
a reduction across the score tiles. attn_output cannot stand in for P . v: the benchmark's
inputs are independent draws.

Two extra costs, both measured in docs/design-decoder-layer.md:
- g_ffn and g_ai are fp32 [T, H]: the norm-weight gradients are fp32 sums over T rows of
  them, and rounding them to bf16 measured ~1e-3 relative error on those gradients.
- attn_weights are read by TMA, whose row strides must be 16-byte multiples: at a sequence
  length that is not a multiple of 8 they are copied once into padded rows.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..layouts.gemm import GemmTiling
from ..references import decoder_layer as contract
from ..references.inputs import model_dims
from . import errors, padded_rows, rmsnorm_backward
from .calls import CallCache
from .checks import check_same_device, check_tensor
from .gemm import GemmCall, matmul_nt, matmul_nt_batched, matmul_nt_summed, summed_k, weight_gradients
from .gemm.epilogue import DSWIGLU, ROPE_INVERSE, ROW_DOT, SOFTMAX_BWD

# The contract's tensor inputs in signature order (eps follows them) and its outputs.
INPUTS = contract.INPUTS[:-1]
OUTPUTS = contract.OUTPUTS
TMA_STRIDE = 8  # bf16 elements in 16 bytes: TMA's stride granule
# The summed g_ffn product (N = hidden, K = 2 x intermediate) at 129-256 tokens (two tile rows)
# takes 128 x 128 tiles in 2 x 1 clusters instead of the rules' 128 x 160 (at 256 tokens, ms:
# 0.141 against 0.174, cuBLAS's two products 0.138); the FFN's other products take the GEMM
# core's rules.
# 128 x 256 tiles for both FFN products at 129-1536 tokens lost to the rules once their clusters
# fit odd tile-row counts (layouts.gemm.even_clusters). Candidates timed interleaved on the H200,
# at 422 / 613 / 1024 / 1172 / 1382 tokens, ms:
# - dSwiGLU: 128 x 256 0.135 / 0.162 / 0.256 / 0.321 / 0.366, the rules 0.145 / 0.149 / 0.229 /
#   0.310 / 0.316 (cuBLAS's plain go . Wd 0.094 / 0.141 / 0.221 / 0.268 / 0.290);
# - summed: 128 x 256 0.289 / 0.336 / 0.441 / 0.540 / 0.656, the rules 0.227 / 0.308 / 0.446 /
#   0.546 / 0.650.
SHORT_SUMMED_TOKENS = (129, 256)
SHORT_SUMMED = GemmTiling(tile_m=128, tile_n=128, cluster_m=2)


def _checked_key(args, eps, dims):
    return dims


def _checked_entry(key, args, eps, dims):
    return True  # nothing to build: the layer's products dispatch per call (kernels/gemm)


def decoder_layer_backward(grad_output, residual, attn_input, query_states, key_states, value_states,
                           query_states_rotated, key_states_rotated, key_states_repeated, value_states_repeated,
                           cos, sin, attn_weights, attn_output, residual2, ffn_input, gate, up, silu_up,
                           swiglu_output, input_ln_weight, q_weight, k_weight, v_weight, o_weight,
                           post_attn_ln_weight, gate_weight, up_weight, down_weight, variance1, variance2,
                           hidden_states_normalized1, hidden_states_normalized2, eps, *, out=None, add_into=None):
    """The decoder layer backward: -> (grad_input, grad_input_ln_weight, grad_q_weight,
    grad_k_weight, grad_v_weight, grad_o_weight, grad_post_attn_ln_weight, grad_gate_weight,
    grad_up_weight, grad_down_weight), as semantics.md says. Per-head inputs may be
    [b, heads, s, d] views of [b, s, heads, d] storage (read through their strides, never
    copied); query_states, key_states, value_states and key_states_rotated are not read (the
    math does not need them) but are checked. `out`: the ten outputs to write into. `add_into`:
    {name: tensor} for some of the seven projection weights' gradients (ADDABLE), each added
    into in place (the GEMM's `add` epilogue: tensor += this call's gradient, rounded once) and
    returned in its place, as a training step accumulating gradients wants (one add launch a
    weight less); a group's products (gate/up, q/k/v) then run one by one. The
    norm-weight gradients are bitwise repeatable; the products are (the GEMM core's fixed-order
    stream-K). Intermediates come from PyTorch's caching allocator; head_dim must be a multiple
    of 32 (the inverse RoPE's tiles), every width a multiple of 8."""
    args = dict(zip(INPUTS, (
        grad_output, residual, attn_input, query_states, key_states, value_states, query_states_rotated,
        key_states_rotated, key_states_repeated, value_states_repeated, cos, sin, attn_weights, attn_output,
        residual2, ffn_input, gate, up, silu_up, swiglu_output, input_ln_weight, q_weight, k_weight, v_weight,
        o_weight, post_attn_ln_weight, gate_weight, up_weight, down_weight, variance1, variance2,
        hidden_states_normalized1, hidden_states_normalized2)))
    dims = _dims(args)
    errors.raise_pending(dims[-1].index)
    first = dims not in _checked  # the full checks run on a shape's first call and to explain an error
    if first:
        _checked.first_call(args, eps, dims)
    outs = _outputs(out, args, dims[2], check=first)
    adds = ()
    if add_into:
        outs, adds = _with_added(outs, add_into, args)
    try:
        return _backward(args, float(eps), dims, outs, adds)
    except Exception:
        _check_inputs(args, eps, dims)  # a kernel's C entry point refused an argument: say which, in our words
        _outputs(out, args, dims[2], check=True)
        raise


def _backward(args, eps, dims, outs, adds=()):
    """The fourteen steps on checked arguments; `adds`: the outputs' indices added into."""
    (grad_output, residual, attn_input, _, _, _, query_states_rotated, _, key_states_repeated, value_states_repeated,
     cos, sin, attn_weights, attn_output, residual2, ffn_input, gate, up, silu_up, swiglu_output, input_ln_weight,
     q_weight, k_weight, v_weight, o_weight, post_attn_ln_weight, gate_weight, up_weight, down_weight, variance1,
     variance2, hidden_states_normalized1, hidden_states_normalized2) = args.values()
    batch, seq, hidden, head_dim, q_heads, kv_heads, _, _ = dims
    (grad_input, grad_input_ln_weight, grad_q_weight, grad_k_weight, grad_v_weight, grad_o_weight,
     grad_post_attn_ln_weight, grad_gate_weight, grad_up_weight, grad_down_weight) = outs
    tokens = batch * seq
    if tokens == 0:
        for i, t in enumerate(outs[1:], 1):
            if i not in adds:
                t.zero_()
        return outs
    bf16, fp32 = torch.bfloat16, torch.float32
    device = grad_output.device

    def flat(t):  # [b, s, X] -> [T, X] (checked: the token dimensions flatten)
        return t.view(tokens, t.shape[-1])

    def heads(t):  # [T, heads * d] -> [b, heads, s, d]
        return t.view(batch, seq, -1, head_dim).transpose(1, 2)

    go = flat(grad_output)
    low, high = SHORT_SUMMED_TOKENS
    summed_tiling = SHORT_SUMMED if low <= tokens <= high else None
    # 1-4: the SwiGLU FFN.
    g_gate, g_up = matmul_nt(go, down_weight.t(), epilogue="dswiglu", inputs=(flat(gate), flat(up), flat(silu_up)))
    weight_gradients([go.t()], flat(swiglu_output).t(), [grad_down_weight], [9 in adds])
    g_ffn = matmul_nt_summed([(g_gate, gate_weight.t()), (g_up, up_weight.t())], out_dtype=fp32,
                             tiling=summed_tiling)
    weight_gradients([g_gate.t(), g_up.t()], flat(ffn_input).t(), [grad_gate_weight, grad_up_weight],
                     [7 in adds, 8 in adds])
    del g_gate, g_up
    # 5: the post-attention norm; residual2's gradient also carries go straight through.
    g_attn = torch.empty_like(grad_output)
    rmsnorm_backward.residual_norm_backward(g_ffn.view(batch, seq, hidden), residual2, hidden_states_normalized2,
                                            variance2, eps, post_attn_ln_weight, grad_output, g_attn,
                                            grad_post_attn_ln_weight)
    del g_ffn
    # 6-7: the output projection; D per (token, head) for the softmax backward.
    probs = _tma_rows(attn_weights)
    pv = torch.empty(tokens, q_heads * head_dim, dtype=bf16, device=device)
    matmul_nt_batched(probs, value_states_repeated.transpose(-1, -2), out=heads(pv))
    g_ao = torch.empty(tokens, q_heads * head_dim, dtype=bf16, device=device)
    d_rows = torch.empty(tokens, q_heads, dtype=fp32, device=device)
    matmul_nt(flat(g_attn), o_weight.t(), out=g_ao, epilogue="row_dot", inputs=(pv,), rows=d_rows)
    del pv
    weight_gradients([flat(g_attn).t()], flat(attn_output).t(), [grad_o_weight], [5 in adds])
    # 9-11 in the order that frees the [b, heads, s, s] tensors soonest (P's padded copy and g_s
    # are each 210 MB at 449 x 16): dv first (P and g_ao only), then g_s, then dq and dk from it.
    # dq, dk, dv each go into their [T, heads * d] rows through the head view; dk and dv sum each
    # kv head's group of query heads inside one product (its group's k-tiles end to end), in
    # whole tiles: stream-K's ragged-wave split cost more than it saved (449 x 16, us: dv 112 ->
    # 97, dk 120 -> 103; even at 373 x 8 and 1024 x 2).
    group, whole_tiles = q_heads // kv_heads, False
    dq = torch.empty(tokens, q_heads * head_dim, dtype=bf16, device=device)
    dk, dv = (torch.empty(tokens, kv_heads * head_dim, dtype=bf16, device=device) for _ in range(2))
    matmul_nt_batched(probs.transpose(-1, -2), heads(g_ao).transpose(-1, -2), out=heads(dv), group_sum=group,
                      stream_k=whole_tiles)
    # 8: g_s per (batch, head), rows padded to TMA's stride granule: written over P's padded copy
    # where there is one (this epilogue is P's last reader, and it reads each piece of P before
    # it writes the same piece of g_s; tiles are disjoint), which saves 210 MB at 449 x 16.
    g_s = probs if probs is not attn_weights else _padded_scores(batch, q_heads, seq, device)
    d_heads = d_rows.view(batch, seq, q_heads).transpose(1, 2)  # [b, heads, s], read in place (stride q_heads)
    matmul_nt_batched(heads(g_ao), value_states_repeated, out=g_s, epilogue="softmax_bwd", inputs=(probs,),
                      rows=d_heads, alpha=1 / math.sqrt(head_dim))
    del probs, g_ao

    def tables(count):  # cos and sin for `count` heads, a view: one table for all
        return tuple(t.unsqueeze(1).expand(batch, count, seq, head_dim) for t in (cos, sin))

    matmul_nt_batched(g_s, key_states_repeated.transpose(-1, -2), out=heads(dq), epilogue="rope_inverse",
                      inputs=tables(q_heads))
    matmul_nt_batched(g_s.transpose(-1, -2), query_states_rotated.transpose(-1, -2), out=heads(dk),
                      epilogue="rope_inverse", inputs=tables(kv_heads), group_sum=group, stream_k=whole_tiles)
    del g_s
    # 12-14: the q/k/v projections and the input norm.
    g_ai = matmul_nt_summed([(dq, q_weight.t()), (dk, k_weight.t()), (dv, v_weight.t())], out_dtype=fp32)
    weight_gradients([dq.t(), dk.t(), dv.t()], flat(attn_input).t(), [grad_q_weight, grad_k_weight, grad_v_weight],
                     [i in adds for i in (2, 3, 4)])
    rmsnorm_backward.residual_norm_backward(g_ai.view(batch, seq, hidden), residual, hidden_states_normalized1,
                                            variance1, eps, input_ln_weight, g_attn, grad_input,
                                            grad_input_ln_weight)
    return outs


# The outputs add_into may name, and the weight each is the gradient of.
ADDABLE = {"grad_q_weight": "q_weight", "grad_k_weight": "k_weight", "grad_v_weight": "v_weight",
           "grad_o_weight": "o_weight", "grad_gate_weight": "gate_weight", "grad_up_weight": "up_weight",
           "grad_down_weight": "down_weight"}


def _with_added(outs, add_into, args):
    """(the outputs with add_into's tensors in their places, their indices), each checked (every
    call: a few microseconds against a layer's milliseconds)."""
    if not isinstance(add_into, dict) or not set(add_into) <= set(ADDABLE):
        raise ValueError(f"add_into: a dict from some of {tuple(ADDABLE)} to the tensors to add into")
    outs = list(outs)
    for name, t in add_into.items():
        check_tensor(f"add_into[{name}]", t, dtypes=torch.bfloat16, shape=tuple(args[ADDABLE[name]].shape))
        check_same_device(grad_output=args["grad_output"], **{f"add_into[{name}]": t})
        outs[OUTPUTS.index(name)] = t
    return tuple(outs), frozenset(OUTPUTS.index(name) for name in add_into)


def gemm_calls(batch: int, seq: int, dims: dict | None = None) -> list[GemmCall]:
    """The GEMM core's calls of `_backward` at (batch, seq) with the model's dims (semantics.md's,
    or `dims` overriding some), in its order, from shapes alone: what the audit compiles for a
    GPU's first call. tests/test_dispatch.py holds them to the calls `_backward` makes."""
    dims = model_dims(contract.DIMS, dims)
    hidden, d, inter = dims["hidden"], dims["head_dim"], dims["intermediate"]
    q_heads, kv_heads = dims["q_heads"], dims["kv_heads"]
    tokens, group = batch * seq, q_heads // kv_heads
    if tokens == 0:
        return []
    low, high = SHORT_SUMMED_TOKENS
    heads, kv_sums = dict(batches=batch * q_heads, batched=1), dict(batches=batch * kv_heads, batched=group)
    softmax_bwd = dataclasses.replace(SOFTMAX_BWD, alpha=1 / math.sqrt(d))
    # (A K-major?, B K-major?): weights and the attention's second operands are read transposed
    return [
        GemmCall(tokens, inter, hidden, True, False, epilogue=DSWIGLU),  # 1: g_sw -> g_gate, g_up
        GemmCall(hidden, inter, tokens, False, False),  # 2: grad_down_weight
        GemmCall(tokens, hidden, 2 * inter, True, False, "float32", products=2, stack="k",
                 tiling=SHORT_SUMMED if low <= tokens <= high else None),  # 3: g_ffn
        GemmCall(2 * inter, hidden, tokens, False, False, products=2),  # 4: grad_gate/up_weight
        GemmCall(seq, d, seq, True, False, **heads),  # 6: P . v
        GemmCall(tokens, q_heads * d, hidden, True, False, epilogue=ROW_DOT, group_n=d),  # 6: g_ao, D
        GemmCall(hidden, q_heads * d, tokens, False, False),  # 7: grad_o_weight
        GemmCall(seq, d, summed_k(seq, group), False, False, **kv_sums),  # 11: dv
        GemmCall(seq, seq, d, True, True, epilogue=softmax_bwd, **heads),  # 8: g_s
        GemmCall(seq, d, seq, True, False, epilogue=ROPE_INVERSE, group_n=d, **heads),  # 9: dq
        GemmCall(seq, d, summed_k(seq, group), False, False, epilogue=ROPE_INVERSE, group_n=d, **kv_sums),  # 10: dk
        GemmCall(tokens, hidden, (q_heads + 2 * kv_heads) * d, True, False, "float32", products=3,
                 stack="k"),  # 12: g_ai
        GemmCall((q_heads + 2 * kv_heads) * d, hidden, tokens, False, False, products=3),  # 13: grad_q/k/v_weight
    ]


def _tma_rows(scores):
    """[b, heads, s, s] scores whose rows TMA can step (a 16-byte multiple row stride): the
    tensor itself, or, at a sequence length that is not a multiple of 8, a copy with padded rows
    (kernels/padded_rows.py: 16-byte stores, where PyTorch's strided copy stores 2 bytes at a
    time)."""
    if all(scores.stride(i) % TMA_STRIDE == 0 for i in range(3)) and scores.stride(3) == 1:
        return scores
    batch, q_heads, seq, _ = scores.shape
    padded = _padded_scores(batch, q_heads, seq, scores.device)
    if scores.is_contiguous():  # (as the contract makes them) our copy; any other strides: PyTorch's
        return padded_rows.copy_padded_rows(scores, padded)
    return padded.copy_(scores)


def _padded_scores(batch, q_heads, seq, device):
    """A bf16 [b, heads, s, s] tensor with rows padded to a multiple of 8 elements."""
    padded = -(-seq // TMA_STRIDE) * TMA_STRIDE
    return torch.empty(batch, q_heads, seq, padded, dtype=torch.bfloat16, device=device)[..., :seq]


def _dims(args):
    """(batch, seq, hidden, head_dim, q_heads, kv_heads, intermediate, device): the cache key
    of the full check; raises TypeError for a non-tensor where one is needed."""
    try:
        batch, seq, hidden = args["grad_output"].shape
        head_dim = args["cos"].shape[-1]
        return (batch, seq, hidden, head_dim, args["q_weight"].shape[0] // max(head_dim, 1),
                args["k_weight"].shape[0] // max(head_dim, 1), args["gate_weight"].shape[0],
                args["grad_output"].device)
    except (AttributeError, ValueError) as error:
        raise TypeError(f"grad_output, cos, q_weight, k_weight, gate_weight: expected tensors of the contract's "
                        f"ranks ({error})") from None


def _check_inputs(args, eps, dims):
    """Every input's dtype, shape, device and the layouts the kernels read in place; messages name
    the argument."""
    batch, seq, hidden, head_dim, q_heads, kv_heads, inter, _ = dims
    if head_dim % 32 or head_dim == 0:
        raise ValueError(f"cos: head_dim {head_dim} must be a positive multiple of 32 (the inverse RoPE's tiles)")
    if hidden % 8 or inter % 8 or not kv_heads or q_heads % kv_heads:
        raise ValueError(f"dimensions: hidden {hidden} and intermediate {inter} must be multiples of 8, and q heads "
                         f"{q_heads} a multiple of kv heads {kv_heads}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise TypeError(f"eps: expected a non-negative float, got {eps!r}")
    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
    token_rows = {"grad_output": hidden, "residual": hidden, "attn_input": hidden, "attn_output": q_width,
                  "residual2": hidden, "ffn_input": hidden, "gate": inter, "up": inter, "silu_up": inter,
                  "swiglu_output": inter, "variance1": 1, "variance2": 1, "hidden_states_normalized1": hidden,
                  "hidden_states_normalized2": hidden, "cos": head_dim, "sin": head_dim}
    per_head = {"query_states": q_heads, "key_states": kv_heads, "value_states": kv_heads,
                "query_states_rotated": q_heads, "key_states_rotated": kv_heads, "key_states_repeated": q_heads,
                "value_states_repeated": q_heads}
    weights = {"input_ln_weight": (hidden,), "post_attn_ln_weight": (hidden,), "q_weight": (q_width, hidden),
               "k_weight": (kv_width, hidden), "v_weight": (kv_width, hidden), "o_weight": (hidden, q_width),
               "gate_weight": (inter, hidden), "up_weight": (inter, hidden), "down_weight": (hidden, inter)}
    fp32_inputs = ("variance1", "variance2", "hidden_states_normalized1", "hidden_states_normalized2")
    for name, width in token_rows.items():
        t = args[name]
        check_tensor(name, t, dtypes=torch.float32 if name in fp32_inputs else torch.bfloat16,
                     shape=(batch, seq, width), contiguous=False, align=4 if width == 1 else 16)
        if width > 1 and (t.stride(2) != 1 or t.stride(1) % 8 or not _flattens(t)):
            raise ValueError(f"{name}: expected [b, s, {width}] rows with a contiguous last dimension, a row stride "
                             f"that is a multiple of 8 and batch rows that follow on (they are read as [T, {width}]), "
                             f"got strides {t.stride()}")
    for name, count in per_head.items():
        t = args[name]
        check_tensor(name, t, dtypes=torch.bfloat16, shape=(batch, count, seq, head_dim), contiguous=False)
        if t.stride(3) != 1 or any(t.stride(i) % 8 for i in range(3)):
            raise ValueError(f"{name}: expected a contiguous last dimension and other strides that are multiples of 8 "
                             f"(a [b, heads, s, d] tensor or a view of [b, s, heads, d] storage), got {t.stride()}")
    check_tensor("attn_weights", args["attn_weights"], dtypes=torch.bfloat16, shape=(batch, q_heads, seq, seq),
                 contiguous=False)
    if args["attn_weights"].stride(3) != 1 and seq > 1:
        raise ValueError(f"attn_weights: expected a contiguous last dimension, got strides "
                         f"{args['attn_weights'].stride()}")
    for name, shape in weights.items():
        check_tensor(name, args[name], dtypes=torch.bfloat16, shape=shape, contiguous=True)
    check_same_device(**args)


# (b, s, widths, device) whose full argument check has passed once
_checked = CallCache(_checked_key, _check_inputs, _checked_entry)


def _flattens(t) -> bool:
    """Whether [b, s, X] views as [b * s, X] without a copy."""
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def _outputs(out, args, hidden, check: bool = True):
    """The caller's ten outputs (checked with `check`; otherwise the kernels' C entry points
    check what they write), or new ones (bf16 like their tensors, fp32 norm-weight gradients)."""
    like = (args["grad_output"], None, args["q_weight"], args["k_weight"], args["v_weight"], args["o_weight"],
            None, args["gate_weight"], args["up_weight"], args["down_weight"])
    if out is None:
        return tuple(torch.empty(hidden, dtype=torch.float32, device=args["grad_output"].device) if t is None
                     else torch.empty_like(t, memory_format=torch.contiguous_format) for t in like)
    if not isinstance(out, (tuple, list)) or len(out) != len(OUTPUTS):
        raise ValueError(f"out: a tuple of the ten outputs {OUTPUTS}")
    if not check:
        return tuple(out)
    for name, t, model in zip(OUTPUTS, out, like):
        shape = (hidden,) if model is None else tuple(model.shape)
        check_tensor(f"out[{name}]", t, dtypes=torch.float32 if model is None else torch.bfloat16, shape=shape)
    check_same_device(grad_output=args["grad_output"], **{f"out[{n}]": t for n, t in zip(OUTPUTS, out)})
    return tuple(out)
