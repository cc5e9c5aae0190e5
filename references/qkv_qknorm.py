"""L1/051 Gemma3 QKV projection with Q/K RMSNorm backward (Gemma-3-270m): the contract.

Forward: q, k, v = hidden @ W^T, viewed per head as [b, heads, s, d]; q and k go through
Gemma3's RMSNorm with scale (1 + w); v is used as is. The backward takes the norm gradient
per head from the saved normed rows (query_transposed and key_transposed are not read),
rounding g * (1 + w) and then dq, dk to bf16, and runs the three projection backwards as
[T, heads * d] matrices.
"""

import torch

from .inputs import InputDraw, as_dtype, compute_dtype, model_dims, round_bf16, rsqrt_mean_square
from .rmsnorm import Evaluation, normalized_dx

bf16, fp32 = torch.bfloat16, torch.float32

DIMS = {"hidden": 640, "q_heads": 4, "kv_heads": 1, "head_dim": 256}
EPS = 1e-6  # Gemma3 rms_norm_eps
INPUTS = (
    "grad_query", "grad_key", "grad_value", "hidden_states", "q_weight", "k_weight", "v_weight",
    "q_norm_weight", "k_norm_weight", "query_transposed", "key_transposed", "q_rstd", "k_rstd",
    "q_normed", "k_normed", "rms_norm_eps",
)  # fmt: skip
OUTPUTS = (
    "grad_hidden_states", "grad_q_weight", "grad_k_weight", "grad_v_weight",
    "grad_q_norm_weight", "grad_k_norm_weight",
)  # fmt: skip
OUTPUT_DTYPES = (bf16, bf16, bf16, bf16, fp32, fp32)
UNREAD_INPUTS = ("query_transposed", "key_transposed")


def qkv_qknorm_backward(
    grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight,
    q_norm_weight, k_norm_weight, query_transposed, key_transposed, q_rstd, k_rstd,
    q_normed, k_normed, rms_norm_eps, *, exact=False,
):  # fmt: skip
    """-> grad_hidden_states, grad_q_weight, grad_k_weight, grad_v_weight,
    grad_q_norm_weight, grad_k_norm_weight.

    rms_norm_eps is part of the signature but already inside the given rstd; query_transposed
    and key_transposed are in the signature and not read.
    """
    del rms_norm_eps, query_transposed, key_transposed
    ev = Evaluation(exact)
    batch, seq, hidden = hidden_states.shape
    tokens = batch * seq

    def norm_backward(grad, norm_weight, rstd, normed):
        grad, normed = ev(grad), ev(normed)
        grad_norm_weight = (grad * normed).sum((0, 1, 2))
        gn = ev.bf16(grad * (1 + ev(norm_weight)))
        return ev.bf16(normalized_dx(gn, normed, ev(rstd))), grad_norm_weight

    def as_rows(per_head):  # [b, heads, s, d] -> [T, heads * d], the projection's layout
        return per_head.transpose(1, 2).reshape(tokens, -1)

    dq, grad_q_norm_weight = norm_backward(grad_query, q_norm_weight, q_rstd, q_normed)
    dk, grad_k_norm_weight = norm_backward(grad_key, k_norm_weight, k_rstd, k_normed)
    grad_q, grad_k, grad_v = as_rows(dq), as_rows(dk), as_rows(ev(grad_value))
    x = hidden_states.reshape(tokens, hidden)

    # The three input-gradient products are summed as bf16 tensors, each sum rounded.
    partial = ev.bf16(ev.product(grad_q, q_weight) + ev.product(grad_k, k_weight))
    grad_hidden_states = ev.bf16(partial + ev.product(grad_v, v_weight))
    outputs = (
        grad_hidden_states.reshape(batch, seq, hidden),
        ev.product(grad_q.T, x),
        ev.product(grad_k.T, x),
        ev.product(grad_v.T, x),
        grad_q_norm_weight,
        grad_k_norm_weight,
    )
    return ev.finish(outputs, OUTPUT_DTYPES)


def forward_leaves(batch, seq, *, device="cpu", seed=0, dims=None, dtype=None):
    """The forward pass's leaves (activations, weights) and the upstream gradients."""
    dims = model_dims(DIMS, dims)
    hidden, head_dim = dims["hidden"], dims["head_dim"]
    q_heads, kv_heads = dims["q_heads"], dims["kv_heads"]
    draw = InputDraw(seed, device, dtype)
    return {
        "hidden_states": draw.randn((batch, seq, hidden), bf16),
        "q_weight": draw.linear_weight(q_heads * head_dim, hidden, bf16),
        "k_weight": draw.linear_weight(kv_heads * head_dim, hidden, bf16),
        "v_weight": draw.linear_weight(kv_heads * head_dim, hidden, bf16),
        "q_norm_weight": draw.randn((head_dim,), bf16),
        "k_norm_weight": draw.randn((head_dim,), bf16),
        "grad_query": draw.randn((batch, q_heads, seq, head_dim), bf16),
        "grad_key": draw.randn((batch, kv_heads, seq, head_dim), bf16),
        "grad_value": draw.randn((batch, kv_heads, seq, head_dim), bf16),
    }


def forward(leaves, *, eps=EPS, store_bf16=False):
    """-> ({upstream gradient name: output}, saved tensors), differentiable in the leaves.

    store_bf16: round what the bf16 model keeps (q, k, v, the normed values) to bf16.
    """
    dtype = compute_dtype(leaves["hidden_states"])
    hidden_states = leaves["hidden_states"].to(dtype)
    batch, seq, _ = hidden_states.shape
    head_dim = leaves["q_norm_weight"].shape[0]

    def project(name):  # -> [b, heads, s, d]
        out = round_bf16(hidden_states @ leaves[name].to(dtype).T, store_bf16)
        return out.view(batch, seq, -1, head_dim).transpose(1, 2)

    def gemma_norm(x, norm_weight):
        rstd = rsqrt_mean_square(x, eps)
        normed = x * rstd
        return normed * (1 + norm_weight.to(dtype)), rstd, normed

    query_transposed, key_transposed = project("q_weight"), project("k_weight")
    query, q_rstd, q_normed = gemma_norm(query_transposed, leaves["q_norm_weight"])
    key, k_rstd, k_normed = gemma_norm(key_transposed, leaves["k_norm_weight"])
    outputs = {"grad_query": query, "grad_key": key, "grad_value": project("v_weight")}
    saved = {
        "query_transposed": query_transposed, "key_transposed": key_transposed,
        "q_rstd": q_rstd, "k_rstd": k_rstd, "q_normed": q_normed, "k_normed": k_normed,
    }  # fmt: skip
    return outputs, saved


def make_inputs(batch, seq, *, device="cpu", seed=0, dims=None, consistent=False, dtype=None):
    """Inputs in signature order, per-head tensors contiguous [b, heads, s, d]: the benchmark's
    independent random tensors (norm weights all ones), or with consistent=True the saved
    tensors of a real forward pass (random norm weights)."""
    if consistent:
        leaves = forward_leaves(batch, seq, device=device, seed=seed, dims=dims, dtype=dtype)
        with torch.no_grad():
            _, saved = forward(leaves, store_bf16=dtype is None)
        declared = {"q_rstd": fp32, "k_rstd": fp32}
        saved = {name: as_dtype(t, declared.get(name, bf16), dtype).contiguous() for name, t in saved.items()}
        names = INPUTS[:-1]
        return (*(leaves[n] if n in leaves else saved[n] for n in names), EPS)

    dims = model_dims(DIMS, dims)
    hidden, head_dim = dims["hidden"], dims["head_dim"]
    q_heads, kv_heads = dims["q_heads"], dims["kv_heads"]
    draw = InputDraw(seed, device, dtype)
    q_shape, kv_shape = (batch, q_heads, seq, head_dim), (batch, kv_heads, seq, head_dim)
    return (
        draw.randn(q_shape, bf16),  # grad_query
        draw.randn(kv_shape, bf16),  # grad_key
        draw.randn(kv_shape, bf16),  # grad_value
        draw.randn((batch, seq, hidden), bf16),
        draw.linear_weight(q_heads * head_dim, hidden, bf16),
        draw.linear_weight(kv_heads * head_dim, hidden, bf16),
        draw.linear_weight(kv_heads * head_dim, hidden, bf16),
        draw.ones((head_dim,), bf16),  # q_norm_weight
        draw.ones((head_dim,), bf16),  # k_norm_weight
        draw.randn(q_shape, bf16),  # query_transposed
        draw.randn(kv_shape, bf16),  # key_transposed
        draw.rstd((batch, q_heads, seq, 1), fp32),  # q_rstd
        draw.rstd((batch, kv_heads, seq, 1), fp32),  # k_rstd
        draw.randn(q_shape, bf16),  # q_normed
        draw.randn(kv_shape, bf16),  # k_normed
        EPS,
    )
