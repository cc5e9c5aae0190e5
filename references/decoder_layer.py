"""L2/056 decoder layer backward, pre-norm attention + SwiGLU FFN (Voxtral-Small-24B).

The whole layer's backward from saved activations: FFN (silu on `up` in this benchmark),
post-attention RMSNorm, output projection, attention through the saved softmax weights
(masking already inside them), inverse RoPE, grouped K/V heads, Q/K/V projections and the
input RMSNorm. Comments name the contract's lines; g_* are gradients w.r.t. the tensor
after the underscore.
"""

import math

import torch

from .inputs import InputDraw, as_dtype, compute_dtype, model_dims, round_bf16, rsqrt_mean_square
from .rmsnorm import Evaluation, rms_dx

bf16, fp32 = torch.bfloat16, torch.float32

DIMS = {"hidden": 5120, "q_heads": 32, "kv_heads": 8, "head_dim": 160, "intermediate": 14336}
EPS = 1e-5  # Mistral Small 3 rms_norm_eps
ROPE_THETA = 1e6  # the benchmark's Mistral RoPE base
INPUTS = (
    "grad_output", "residual", "attn_input", "query_states", "key_states", "value_states",
    "query_states_rotated", "key_states_rotated", "key_states_repeated", "value_states_repeated",
    "cos", "sin", "attn_weights", "attn_output", "residual2", "ffn_input", "gate", "up", "silu_up",
    "swiglu_output", "input_ln_weight", "q_weight", "k_weight", "v_weight", "o_weight",
    "post_attn_ln_weight", "gate_weight", "up_weight", "down_weight", "variance1", "variance2",
    "hidden_states_normalized1", "hidden_states_normalized2", "eps",
)  # fmt: skip
# The backward needs neither the pre-RoPE q/k/v nor the un-repeated rotated k.
UNREAD_INPUTS = ("query_states", "key_states", "value_states", "key_states_rotated")
# Passed as [b, heads, s, d] views of [b, s, heads, d] storage, as the model's projections leave them.
HEAD_VIEW_INPUTS = ("query_states", "key_states", "value_states", "query_states_rotated")
FP32_INPUTS = ("variance1", "variance2", "hidden_states_normalized1", "hidden_states_normalized2")
OUTPUTS = (
    "grad_input", "grad_input_ln_weight", "grad_q_weight", "grad_k_weight", "grad_v_weight",
    "grad_o_weight", "grad_post_attn_ln_weight", "grad_gate_weight", "grad_up_weight",
    "grad_down_weight",
)  # fmt: skip
OUTPUT_DTYPES = (bf16, fp32, bf16, bf16, bf16, bf16, fp32, bf16, bf16, bf16)


def rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat([-t[..., half:], t[..., :half]], dim=-1)


def decoder_layer_backward(
    grad_output, residual, attn_input, query_states, key_states, value_states,
    query_states_rotated, key_states_rotated, key_states_repeated, value_states_repeated,
    cos, sin, attn_weights, attn_output, residual2, ffn_input, gate, up, silu_up, swiglu_output,
    input_ln_weight, q_weight, k_weight, v_weight, o_weight, post_attn_ln_weight,
    gate_weight, up_weight, down_weight, variance1, variance2,
    hidden_states_normalized1, hidden_states_normalized2, eps,
    *, exact=False,
):  # fmt: skip
    """-> grad_input, grad_input_ln_weight, grad_q_weight, grad_k_weight, grad_v_weight,
    grad_o_weight, grad_post_attn_ln_weight, grad_gate_weight, grad_up_weight, grad_down_weight.

    Per-head inputs may be transposed views of [b, s, heads, d] storage; they are read
    through their strides. As written, every step runs on bf16 tensors as PyTorch runs them
    (the fp32 inputs stay fp32 and promote what they touch); exact: float64 throughout.
    """
    del query_states, key_states, value_states, key_states_rotated  # not in the formula
    ev = Evaluation(exact, elementwise=bf16)
    batch, seq, hidden = grad_output.shape
    _, q_heads, _, head_dim = query_states_rotated.shape
    kv_heads = k_weight.shape[0] // head_dim
    group = q_heads // kv_heads  # query heads per kv head; repeat_kv puts head h in group h // group
    tokens = batch * seq

    def rows(t):  # activations as [T, features] in the compute dtype
        return ev(t).reshape(tokens, -1)

    def per_head(t):  # [T, heads * d] -> [b, heads, s, d]
        return t.view(batch, seq, -1, head_dim).transpose(1, 2)

    def as_rows(t):  # [b, heads, s, d] -> [T, heads * d]
        return t.transpose(1, 2).reshape(tokens, -1)

    def sum_groups(t):  # [b, q_heads, s, d] -> [b, kv_heads, s, d]
        return t.view(batch, kv_heads, group, seq, head_dim).sum(2)

    go = rows(grad_output)
    mm = ev.product

    # SwiGLU FFN: swiglu_output = gate * silu(up), out = residual2 + swiglu_output @ Wd^T.
    g_sw = mm(go, down_weight)
    grad_down_weight = mm(go.T, rows(swiglu_output))
    up_rows = rows(up)
    sig_up = torch.sigmoid(up_rows)
    g_gate = ev.bf16(g_sw * rows(silu_up))
    g_up = ev.bf16(g_sw * rows(gate) * sig_up * (1 + up_rows * (1 - sig_up)))
    g_ffn = mm(g_gate, gate_weight) + mm(g_up, up_weight)
    ffn_rows = rows(ffn_input)
    grad_gate_weight = mm(g_gate.T, ffn_rows)
    grad_up_weight = mm(g_up.T, ffn_rows)

    # Post-attention RMSNorm; residual2's gradient also carries go straight through.
    grad_post_attn_ln_weight = (g_ffn * rows(hidden_states_normalized2)).sum(0)
    rstd2 = torch.rsqrt(rows(variance2) + eps)
    g_attn = ev.bf16(go + rms_dx(g_ffn * ev(post_attn_ln_weight), rows(residual2), rstd2))

    # Output projection and attention, per head [b, heads, s, *].
    g_ao = per_head(mm(g_attn, o_weight))
    grad_o_weight = mm(g_attn.T, rows(attn_output))
    probs = ev(attn_weights)
    g_p = mm(g_ao, value_states_repeated.transpose(-1, -2))
    g_s = ev.bf16(probs * (g_p - (probs * g_p).sum(-1, keepdim=True)) / math.sqrt(head_dim))
    g_qr = mm(g_s, key_states_repeated)
    g_kr = sum_groups(mm(g_s.transpose(-1, -2), query_states_rotated))
    g_v = sum_groups(mm(probs.transpose(-1, -2), g_ao))

    # Inverse RoPE, exact for tables whose two halves are equal (cos/sin broadcast over heads).
    cos, sin = ev(cos).unsqueeze(1), ev(sin).unsqueeze(1)
    g_q = g_qr * cos - rotate_half(g_qr) * sin
    g_k = g_kr * cos - rotate_half(g_kr) * sin

    # Q/K/V projections of attn_input, then the input RMSNorm.
    grad_q, grad_k, grad_v = as_rows(g_q), as_rows(g_k), as_rows(g_v)
    g_ai = mm(grad_q, q_weight) + mm(grad_k, k_weight) + mm(grad_v, v_weight)
    attn_rows = rows(attn_input)
    grad_input_ln_weight = (g_ai * rows(hidden_states_normalized1)).sum(0)
    rstd1 = torch.rsqrt(rows(variance1) + eps)
    grad_input = g_attn + rms_dx(g_ai * ev(input_ln_weight), rows(residual), rstd1)

    outputs = (
        grad_input.reshape(batch, seq, hidden),
        grad_input_ln_weight,
        mm(grad_q.T, attn_rows),
        mm(grad_k.T, attn_rows),
        mm(grad_v.T, attn_rows),
        grad_o_weight,
        grad_post_attn_ln_weight,
        grad_gate_weight,
        grad_up_weight,
        grad_down_weight,
    )
    return ev.finish(outputs, OUTPUT_DTYPES)


def forward_leaves(batch, seq, *, device="cpu", seed=0, dims=None, dtype=None):
    """The forward pass's leaves as 056's generator draws them: residual randn * 0.02, norm
    weights 1 + 0.02 randn, projection weights randn * sqrt(2 / fan_in), RoPE tables for
    positions 0..s-1; and the upstream gradient, randn."""
    dims = model_dims(DIMS, dims)
    hidden, head_dim, inter = dims["hidden"], dims["head_dim"], dims["intermediate"]
    q_width, kv_width = dims["q_heads"] * head_dim, dims["kv_heads"] * head_dim
    draw = InputDraw(seed, device, dtype)
    cos, sin = draw.rope_tables(batch, seq, head_dim, ROPE_THETA, bf16, from_zero=True)

    def projection(out_features, in_features):
        return draw.randn((out_features, in_features), bf16, scale=(2 / in_features) ** 0.5)

    def norm_weight():
        return draw.cast(1 + 0.02 * draw.randn((hidden,), draw.compute), bf16)

    return {
        "residual": draw.randn((batch, seq, hidden), bf16, scale=0.02),
        "input_ln_weight": norm_weight(),
        "q_weight": projection(q_width, hidden),
        "k_weight": projection(kv_width, hidden),
        "v_weight": projection(kv_width, hidden),
        "o_weight": projection(hidden, q_width),
        "post_attn_ln_weight": norm_weight(),
        "gate_weight": projection(inter, hidden),
        "up_weight": projection(inter, hidden),
        "down_weight": projection(hidden, inter),
        "cos": cos,
        "sin": sin,
        "grad_output": draw.randn((batch, seq, hidden), bf16),
    }


def forward(leaves, *, eps=EPS, store_bf16=False):
    """-> ({upstream gradient name: output}, saved tensors), differentiable in the leaves.

    A causal decoder layer as semantics.md writes it. store_bf16 rounds what the bf16
    model keeps in bf16; per-head tensors come out as [b, heads, s, d] views of
    [b, s, heads, d] storage where the benchmark has them so.
    """
    dtype = compute_dtype(leaves["residual"])
    w = {name: t.to(dtype) for name, t in leaves.items() if not name.startswith("grad_")}
    x = w["residual"]
    batch, seq, _ = x.shape
    head_dim = w["cos"].shape[-1]
    q_heads, kv_heads = w["q_weight"].shape[0] // head_dim, w["k_weight"].shape[0] // head_dim

    def store(t):
        return round_bf16(t, store_bf16)

    def project(t, name):  # -> [b, s, heads, d] storage
        return store(t @ w[name].T).view(batch, seq, w[name].shape[0] // head_dim, head_dim)

    def rope(t):  # t in [b, s, heads, d]; the tables broadcast over heads
        cos, sin = w["cos"].unsqueeze(2), w["sin"].unsqueeze(2)
        return store(t * cos + rotate_half(t) * sin)

    def repeat_kv(t):  # [b, kv_heads, s, d] -> [b, q_heads, s, d], head h reads kv head h // group
        return t.repeat_interleave(q_heads // kv_heads, dim=1)

    variance1 = x.pow(2).mean(-1, keepdim=True)
    normalized1 = x * torch.rsqrt(variance1 + eps)
    attn_input = store(normalized1 * w["input_ln_weight"])
    q, k, v = project(attn_input, "q_weight"), project(attn_input, "k_weight"), project(attn_input, "v_weight")
    q_rot, k_rot = rope(q), rope(k)
    key_states_rotated = k_rot.transpose(1, 2).contiguous()
    key_states_repeated = repeat_kv(key_states_rotated)
    value_states_repeated = repeat_kv(v.transpose(1, 2))

    scores = q_rot.transpose(1, 2) @ key_states_repeated.transpose(-1, -2) / math.sqrt(head_dim)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
    attn_weights = store(torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1))
    attn_output = store((attn_weights @ value_states_repeated).transpose(1, 2).reshape(batch, seq, q_heads * head_dim))
    residual2 = store(x + attn_output @ w["o_weight"].T)

    variance2 = residual2.pow(2).mean(-1, keepdim=True)
    normalized2 = residual2 * torch.rsqrt(variance2 + eps)
    ffn_input = store(normalized2 * w["post_attn_ln_weight"])
    gate, up = store(ffn_input @ w["gate_weight"].T), store(ffn_input @ w["up_weight"].T)
    silu_up = store(torch.nn.functional.silu(up))
    swiglu_output = store(gate * silu_up)
    out = residual2 + swiglu_output @ w["down_weight"].T

    saved = {
        "attn_input": attn_input,
        "query_states": q.transpose(1, 2),
        "key_states": k.transpose(1, 2),
        "value_states": v.transpose(1, 2),
        "query_states_rotated": q_rot.transpose(1, 2),
        "key_states_rotated": key_states_rotated,
        "key_states_repeated": key_states_repeated,
        "value_states_repeated": value_states_repeated,
        "attn_weights": attn_weights,
        "attn_output": attn_output,
        "residual2": residual2,
        "ffn_input": ffn_input,
        "gate": gate,
        "up": up,
        "silu_up": silu_up,
        "swiglu_output": swiglu_output,
        "variance1": variance1,
        "variance2": variance2,
        "hidden_states_normalized1": normalized1,
        "hidden_states_normalized2": normalized2,
    }
    return {"grad_output": out}, saved


def _head_view(storage):
    """[b, s, heads, d] storage seen as [b, heads, s, d], as the benchmark passes q/k/v."""
    return storage.transpose(1, 2)


def make_inputs(batch, seq, *, device="cpu", seed=0, dims=None, consistent=True, dtype=None):
    """Inputs in signature order, from one forward pass as 056's generator makes them (its
    inputs are always forward-consistent; `consistent` is accepted for the shared calling
    convention). query_states, key_states, value_states and query_states_rotated are
    transposed views of [b, s, heads, d] storage."""
    del consistent
    leaves = forward_leaves(batch, seq, device=device, seed=seed, dims=dims, dtype=dtype)
    with torch.no_grad():
        _, saved = forward(leaves, store_bf16=dtype is None)
    saved = {n: as_dtype(t, fp32 if n in FP32_INPUTS else bf16, dtype) for n, t in saved.items()}
    for name in HEAD_VIEW_INPUTS:  # cast the [b, s, heads, d] storage, hand out the view
        saved[name] = _head_view(saved[name].transpose(1, 2).contiguous())
    return (*(leaves[n] if n in leaves else saved[n] for n in INPUTS[:-1]), EPS)
