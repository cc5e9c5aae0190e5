"""The benchmark's workloads and each problem's speed-of-light cost, as semantics.md counts them.

    SOL = max(bytes / copy_bandwidth, flops / bf16_matmul_rate)

bytes: every input the formula reads, once, plus every output, once. flops: 2 per
multiply-add of the matrix products (attention's included); elementwise work is free.
"""

from . import decoder_layer, embedding_rmsnorm, fused_residual_rmsnorm, qkv_qknorm
from .inputs import model_dims

# Ceilings measured on one H200 on 2026-11-30 (a large device copy, an 8192^3 bf16 cuBLAS
# matmul). The bench measures its own in the same run; these reproduce the quoted figures.
H200_COPY_BANDWIDTH = 4.19e12  # bytes/s
H200_BF16_MATMUL_RATE = 778e12  # flop/s

BF16, FP32, INT64 = 2, 4, 8  # bytes per element

# (seq_len, batch_size), in the order semantics.md lists them.
WORKLOADS = {
    "fused_residual_rmsnorm_backward": [
        (128, 1), (131, 1), (211, 2), (256, 2), (773, 2), (853, 4), (997, 16), (1024, 8),
        (1087, 32), (1249, 1), (1657, 32), (1721, 64), (1801, 1), (1973, 4), (4096, 32), (8192, 64),
    ],
    "embedding_rmsnorm_backward": [
        (1, 1), (7, 1), (16, 2), (64, 4), (128, 2), (256, 1), (97, 3), (512, 8), (1024, 4),
        (2048, 8), (4096, 4), (4096, 8),
    ],
    "qkv_qknorm_backward": [
        (128, 2), (128, 4), (128, 8), (128, 32), (128, 64), (131, 1), (256, 4), (256, 8),
        (373, 4), (512, 1), (541, 16), (997, 1), (1024, 1), (1024, 4), (4096, 1), (8192, 1),
    ],
    "decoder_layer_backward": [
        (128, 1), (128, 4), (128, 32), (211, 2), (256, 1), (256, 4), (256, 8), (256, 32),
        (293, 4), (373, 8), (449, 16), (512, 2), (613, 1), (691, 2), (1024, 1), (1024, 2),
    ],
}  # fmt: skip

# Cases beyond the plain workloads, with the make_inputs options that make them: 087's
# "every id is the same" (the scatter's worst contention), at its largest token count.
EXTRA_CASES = {
    "embedding_rmsnorm_backward": [(4096, 8, {"same_ids": True})],
}


def cases(name):
    """Every (seq_len, batch_size, make_inputs options) the benchmark runs for a problem."""
    return [(seq, batch, {}) for seq, batch in WORKLOADS[name]] + EXTRA_CASES.get(name, [])


def sol_seconds(cost, bandwidth=H200_COPY_BANDWIDTH, matmul_rate=H200_BF16_MATMUL_RATE):
    nbytes, flops = cost
    return max(nbytes / bandwidth, flops / matmul_rate)


def fused_residual_rmsnorm_cost(batch, seq, dims=None, *, read_normalized=True):
    """read_normalized=False: the normalized=None call, which recomputes x * rstd."""
    hidden = model_dims(fused_residual_rmsnorm.DIMS, dims)["hidden"]
    rows = batch * seq
    per_element = BF16 + FP32 + (FP32 if read_normalized else 0)  # grad_output, x, normalized
    per_element += 2 * BF16  # grad_hidden_states, grad_residual
    nbytes = rows * hidden * per_element + rows * FP32 + 2 * hidden * FP32  # + rstd, weight, grad_weight
    return nbytes, 0


def embedding_rmsnorm_cost(batch, seq, dims=None, *, accumulate=False, distinct_ids=None, ids_bytes=INT64):
    """Without accumulate the whole [V, H] table is written (zero-filled plus the rows);
    with accumulate=True only the touched rows are read and written, distinct_ids of them
    (default min(T, V), every token a different id)."""
    dims = model_dims(embedding_rmsnorm.DIMS, dims)
    vocab, hidden = dims["vocab"], dims["hidden"]
    rows = batch * seq
    nbytes = rows * hidden * (BF16 + FP32) + rows * (ids_bytes + FP32) + 2 * hidden * FP32
    if accumulate:
        touched = min(rows, vocab) if distinct_ids is None else distinct_ids
        nbytes += 2 * touched * hidden * BF16
    else:
        nbytes += vocab * hidden * BF16
    return nbytes, 0


def qkv_qknorm_cost(batch, seq, dims=None):
    dims = model_dims(qkv_qknorm.DIMS, dims)
    hidden, head_dim = dims["hidden"], dims["head_dim"]
    q_width, kv_width = dims["q_heads"] * head_dim, dims["kv_heads"] * head_dim
    tokens = batch * seq
    qkv_width = q_width + 2 * kv_width
    weights = qkv_width * hidden * BF16
    nbytes = (
        tokens * qkv_width * BF16  # grad_query, grad_key, grad_value
        + tokens * hidden * BF16  # hidden_states
        + weights
        + 2 * head_dim * BF16  # q_norm_weight, k_norm_weight
        + 2 * tokens * (q_width + kv_width) * BF16  # query/key_transposed, q/k_normed
        + tokens * (dims["q_heads"] + dims["kv_heads"]) * FP32  # q_rstd, k_rstd
        + tokens * hidden * BF16  # grad_hidden_states
        + weights  # grad_q/k/v_weight
        + 2 * head_dim * FP32  # grad_q/k_norm_weight
    )
    flops = 2 * (2 * tokens * qkv_width * hidden)  # grad_hidden_states and the weight gradients
    return nbytes, flops


def decoder_layer_cost(batch, seq, dims=None):
    """query_states, key_states, value_states and key_states_rotated are not read."""
    dims = model_dims(decoder_layer.DIMS, dims)
    hidden, head_dim, inter = dims["hidden"], dims["head_dim"], dims["intermediate"]
    q_heads = dims["q_heads"]
    q_width, kv_width = q_heads * head_dim, dims["kv_heads"] * head_dim
    tokens = batch * seq
    weights = (
        (q_width + 2 * kv_width) * hidden  # q, k, v
        + hidden * q_width  # o
        + 3 * inter * hidden  # gate, up, down
    ) * BF16
    activations = (
        5 * tokens * hidden * BF16  # grad_output, residual, attn_input, residual2, ffn_input
        + 3 * tokens * q_width * BF16  # query_states_rotated, key/value_states_repeated
        + 2 * tokens * head_dim * BF16  # cos, sin
        + batch * q_heads * seq * seq * BF16  # attn_weights
        + tokens * q_width * BF16  # attn_output
        + 4 * tokens * inter * BF16  # gate, up, silu_up, swiglu_output
        + 2 * tokens * FP32  # variance1, variance2
        + 2 * tokens * hidden * FP32  # hidden_states_normalized1, 2
    )
    norm_weights = 2 * hidden * BF16  # input_ln_weight, post_attn_ln_weight
    outputs = tokens * hidden * BF16 + weights + 2 * hidden * FP32  # grad_input, weight grads, ln grads
    nbytes = activations + weights + norm_weights + outputs

    # Multiply-adds. Each of the 7 projections (q, k, v, o, gate, up, down; widths summed,
    # the other side is hidden) has two products: its input gradient and its weight gradient.
    projections = 2 * tokens * hidden * ((q_width + 2 * kv_width) + q_width + 3 * inter)
    attention = 4 * batch * q_heads * seq * seq * head_dim  # g_p, g_qr, g_kr, g_v
    flops = 2 * (projections + attention)
    return nbytes, flops
