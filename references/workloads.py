"""The benchmark's workloads and each problem's speed-of-light cost, as semantics.md counts them.

    SOL = max(bytes / copy_bandwidth, flops / bf16_matmul_rate)

bytes: every input the formula reads, once, plus every output, once. flops: 2 per
multiply-add of the matrix products (attention's included); elementwise work is free.
"""

from . import decoder_layer, embedding_rmsnorm, fused_residual_rmsnorm, qkv_qknorm
from .inputs import model_dims

# Ceilings measured on one H200 (semantics.md: a 2 GiB device copy, an 8192^3 bf16 cuBLAS
# matmul). The bench measures its own in the same run; these reproduce the quoted figures.
H200_COPY_BANDWIDTH = 4.23e12  # bytes/s
H200_BF16_MATMUL_RATE = 781e12  # flop/s

BF16, FP32, INT64 = 2, 4, 8  # bytes per element

# (seq_len, batch_size): atol, in the order semantics.md (version 2) lists them; rtol is RTOL
# everywhere. The benchmark's own per-workload tolerances.
RTOL = 0.05
ATOL = {
    "fused_residual_rmsnorm_backward": {
        (128, 1): 1e-5, (131, 1): 1e-5, (211, 2): 1e-5, (256, 2): 1e-5, (773, 2): 1.2e-5, (853, 4): 2.1e-5,
        (997, 16): 6.4e-5, (1024, 8): 4.7e-5, (1087, 32): 8.9e-5, (1249, 1): 1.4e-5, (1657, 32): 1.5e-4,
        (1721, 64): 1.5e-4, (1801, 1): 1.2e-5, (1973, 4): 4.7e-5, (4096, 32): 2.2e-4, (8192, 64): 7e-4,
    },
    "embedding_rmsnorm_backward": {
        workload: 1e-5 for workload in (
            (128, 64), (211, 8), (256, 1), (256, 4), (256, 64), (293, 16), (373, 32), (512, 1), (512, 2),
            (512, 16), (512, 32), (541, 4), (1024, 1), (1024, 32), (2048, 2), (4096, 8),
        )
    },
    "qkv_qknorm_backward": {
        (128, 2): 0.0088, (128, 4): 0.0088, (128, 8): 0.0088, (128, 32): 0.018, (128, 64): 0.028,
        (131, 1): 0.016, (256, 4): 0.015, (256, 8): 0.028, (373, 4): 0.017, (512, 1): 0.011,
        (541, 16): 0.028, (997, 1): 0.017, (1024, 1): 0.0098, (1024, 4): 0.016, (4096, 1): 0.016,
        (8192, 1): 0.019,
    },
    "decoder_layer_backward": {
        (128, 1): 8.1, (128, 4): 12, (128, 32): 12, (211, 2): 12, (256, 1): 13, (256, 4): 13, (256, 8): 13,
        (256, 32): 16, (293, 4): 11, (373, 8): 13, (449, 16): 17, (512, 2): 15, (613, 1): 12, (691, 2): 15,
        (1024, 1): 13, (1024, 2): 15,
    },
}  # fmt: skip
WORKLOADS = {name: list(table) for name, table in ATOL.items()}

# Cases beyond the plain workloads, with the make_inputs options that make them: 087's
# "every id is the same" (the scatter's worst contention), at its largest token count.
EXTRA_CASES = {
    "embedding_rmsnorm_backward": [(4096, 8, {"same_ids": True})],
}


def cases(name):
    """Every (seq_len, batch_size, make_inputs options) the bench runs for a problem."""
    return [(seq, batch, {}) for seq, batch in WORKLOADS[name]] + EXTRA_CASES.get(name, [])


def atol(name, seq, batch):
    """The workload's atol; for a shape the benchmark does not list, that of the listed workload
    with the nearest token count (the tolerances grow with the reductions' length)."""
    table = ATOL[name]
    if (seq, batch) in table:
        return table[seq, batch]
    nearest = min(table, key=lambda w: (abs(w[0] * w[1] - seq * batch), w))
    return table[nearest]


def sol_seconds(cost, bandwidth=H200_COPY_BANDWIDTH, matmul_rate=H200_BF16_MATMUL_RATE):
    nbytes, flops = cost
    return max(nbytes / bandwidth, flops / matmul_rate)


def fused_residual_rmsnorm_cost(batch, seq, dims=None):
    """10 bytes an element: grad_output and normalized read (or x, with normalized=None), both
    bf16 gradients written."""
    hidden = model_dims(fused_residual_rmsnorm.DIMS, dims)["hidden"]
    rows = batch * seq
    per_element = BF16 + FP32  # grad_output, normalized
    per_element += 2 * BF16  # grad_hidden_states, grad_residual
    nbytes = rows * hidden * per_element + rows * FP32 + 2 * hidden * FP32  # + rstd, weight, grad_weight
    return nbytes, 0


def embedding_rmsnorm_cost(batch, seq, dims=None, *, accumulate=False, distinct_ids=None, ids_bytes=INT64,
                           weight_bytes=BF16):
    """Without accumulate the whole [V, H] table is written (zero-filled plus the rows);
    with accumulate=True only the touched rows are read and written, distinct_ids of them
    (default min(T, V), every token a different id). weight_bytes: norm_weight's element size,
    which grad_norm_weight shares (bf16 in the benchmark)."""
    dims = model_dims(embedding_rmsnorm.DIMS, dims)
    vocab, hidden = dims["vocab"], dims["hidden"]
    rows = batch * seq
    nbytes = rows * hidden * (BF16 + FP32) + rows * (ids_bytes + FP32) + 2 * hidden * weight_bytes
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
        + tokens * (q_width + kv_width) * BF16  # q_normed, k_normed (query/key_transposed are not read)
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
