"""The plain-PyTorch references against autograd, their input generators, and the SOL counts.

CPU only, tiny model dimensions, float64 where the math is checked.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cutebwd.references import ATOL, PROBLEMS, WORKLOADS, atol, sol_seconds
from cutebwd.references import decoder_layer, embedding_rmsnorm, fused_residual_rmsnorm, qkv_qknorm
from cutebwd.references.workloads import cases, embedding_rmsnorm_cost, fused_residual_rmsnorm_cost

# Mean speed of light over each problem's workloads at the H200 ceilings of semantics.md
# (4.23 TB/s, 781 TFLOP/s), worked out by hand from the counted bytes and FLOPs.
SOL_013, SOL_087, SOL_051, SOL_056 = 0.338e-3, 0.179e-3, 14.6e-6, 3.17e-3

bf16, fp32, f64 = torch.bfloat16, torch.float32, torch.float64

TINY_DIMS = {
    "fused_residual_rmsnorm_backward": {"hidden": 16},
    "embedding_rmsnorm_backward": {"vocab": 12, "hidden": 16},  # 10 tokens over 12 ids: duplicates
    "qkv_qknorm_backward": {"hidden": 24, "q_heads": 4, "kv_heads": 1, "head_dim": 8},
    "decoder_layer_backward": {"hidden": 32, "q_heads": 4, "kv_heads": 2, "head_dim": 8, "intermediate": 40},
}
BATCH, SEQ = 2, 5
NAMES = list(PROBLEMS)

# Which forward leaf each output is the gradient of (x = hidden_states + residual in 013).
GRADIENT_OF = {
    "fused_residual_rmsnorm_backward": {
        "grad_hidden_states": "hidden_states", "grad_residual": "residual", "grad_weight": "weight",
    },
    "embedding_rmsnorm_backward": {"grad_embed_weight": "embedding", "grad_norm_weight": "norm_weight"},
    "qkv_qknorm_backward": {
        "grad_hidden_states": "hidden_states", "grad_q_weight": "q_weight", "grad_k_weight": "k_weight",
        "grad_v_weight": "v_weight", "grad_q_norm_weight": "q_norm_weight", "grad_k_norm_weight": "k_norm_weight",
    },
    "decoder_layer_backward": {
        "grad_input": "residual", "grad_input_ln_weight": "input_ln_weight", "grad_q_weight": "q_weight",
        "grad_k_weight": "k_weight", "grad_v_weight": "v_weight", "grad_o_weight": "o_weight",
        "grad_post_attn_ln_weight": "post_attn_ln_weight", "grad_gate_weight": "gate_weight",
        "grad_up_weight": "up_weight", "grad_down_weight": "down_weight",
    },
}  # fmt: skip


def declared_inputs(name, b, s, dims):
    """semantics.md's input tables: name -> (shape, dtype), written out independently of the modules."""
    if name == "fused_residual_rmsnorm_backward":
        h = dims["hidden"]
        return {
            "grad_output": ((b, s, h), bf16), "x": ((b, s, h), fp32), "normalized": ((b, s, h), fp32),
            "rstd": ((b, s, 1), fp32), "weight": ((h,), fp32),
        }  # fmt: skip
    if name == "embedding_rmsnorm_backward":
        h = dims["hidden"]
        return {
            "grad_output": ((b, s, h), bf16), "input_ids": ((b, s), torch.int64),
            "hidden_states": ((b, s, h), fp32), "rstd": ((b, s, 1), fp32), "norm_weight": ((h,), bf16),
        }  # fmt: skip
    if name == "qkv_qknorm_backward":
        h, d, nq, nkv = dims["hidden"], dims["head_dim"], dims["q_heads"], dims["kv_heads"]
        return {
            "grad_query": ((b, nq, s, d), bf16), "grad_key": ((b, nkv, s, d), bf16),
            "grad_value": ((b, nkv, s, d), bf16), "hidden_states": ((b, s, h), bf16),
            "q_weight": ((nq * d, h), bf16), "k_weight": ((nkv * d, h), bf16), "v_weight": ((nkv * d, h), bf16),
            "q_norm_weight": ((d,), bf16), "k_norm_weight": ((d,), bf16),
            "query_transposed": ((b, nq, s, d), bf16), "key_transposed": ((b, nkv, s, d), bf16),
            "q_rstd": ((b, nq, s, 1), fp32), "k_rstd": ((b, nkv, s, 1), fp32),
            "q_normed": ((b, nq, s, d), bf16), "k_normed": ((b, nkv, s, d), bf16), "rms_norm_eps": float,
        }  # fmt: skip
    h, d, nq, nkv, i = (dims[k] for k in ("hidden", "head_dim", "q_heads", "kv_heads", "intermediate"))
    act, q_heads, kv_heads, ffn = ((b, s, h), bf16), ((b, nq, s, d), bf16), ((b, nkv, s, d), bf16), ((b, s, i), bf16)
    return {
        "grad_output": act, "residual": act, "attn_input": act, "query_states": q_heads,
        "key_states": kv_heads, "value_states": kv_heads, "query_states_rotated": q_heads,
        "key_states_rotated": kv_heads, "key_states_repeated": q_heads, "value_states_repeated": q_heads,
        "cos": ((b, s, d), bf16), "sin": ((b, s, d), bf16), "attn_weights": ((b, nq, s, s), bf16),
        "attn_output": ((b, s, nq * d), bf16), "residual2": act, "ffn_input": act, "gate": ffn, "up": ffn,
        "silu_up": ffn, "swiglu_output": ffn, "input_ln_weight": ((h,), bf16), "q_weight": ((nq * d, h), bf16),
        "k_weight": ((nkv * d, h), bf16), "v_weight": ((nkv * d, h), bf16), "o_weight": ((h, nq * d), bf16),
        "post_attn_ln_weight": ((h,), bf16), "gate_weight": ((i, h), bf16), "up_weight": ((i, h), bf16),
        "down_weight": ((h, i), bf16), "variance1": ((b, s, 1), fp32), "variance2": ((b, s, 1), fp32),
        "hidden_states_normalized1": ((b, s, h), fp32), "hidden_states_normalized2": ((b, s, h), fp32),
        "eps": float,
    }  # fmt: skip


def declared_outputs(name, b, s, dims):
    """semantics.md's output shapes, in output order."""
    h = dims["hidden"]
    if name == "fused_residual_rmsnorm_backward":
        return [(b, s, h), (b, s, h), (h,)]
    if name == "embedding_rmsnorm_backward":
        return [(dims["vocab"], h), (h,)]
    d = dims["head_dim"]
    q_width, kv_width = dims["q_heads"] * d, dims["kv_heads"] * d
    if name == "qkv_qknorm_backward":
        return [(b, s, h), (q_width, h), (kv_width, h), (kv_width, h), (d,), (d,)]
    i = dims["intermediate"]
    return [(b, s, h), (h,), (q_width, h), (kv_width, h), (kv_width, h), (h, q_width), (h,), (i, h), (i, h), (h, i)]


def tensors(inputs):
    return [t for t in inputs if isinstance(t, torch.Tensor)]


def named_inputs(module, batch, seq, **options):
    return dict(zip(module.INPUTS, module.make_inputs(batch, seq, **options)))


# ---- the references against autograd ------------------------------------------------------


@pytest.mark.parametrize(
    "name, options",
    [(n, {}) for n in NAMES] + [("embedding_rmsnorm_backward", {"same_ids": True})],
)
def test_reference_matches_autograd(name, options):
    problem, dims = PROBLEMS[name], TINY_DIMS[name]
    leaves = problem.module.forward_leaves(BATCH, SEQ, seed=3, dims=dims, dtype=f64, **options)
    wrt = {leaf: leaves[leaf].requires_grad_() for leaf in GRADIENT_OF[name].values()}
    outputs, _ = problem.module.forward(leaves)
    torch.autograd.backward(list(outputs.values()), [leaves[upstream] for upstream in outputs])

    inputs = problem.make_inputs(BATCH, SEQ, seed=3, dims=dims, consistent=True, dtype=f64, **options)
    got = problem.run_exact(inputs, dims=dims)
    assert len(got) == len(problem.output_names)
    for out_name, out in zip(problem.output_names, got):
        assert out.dtype == f64, out_name
        expected = wrt[GRADIENT_OF[name][out_name]].grad
        assert expected.abs().max() > 0.1, f"{out_name}: a vanishing gradient would prove nothing"
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{out_name}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_reference_does_not_mutate_or_care_about_strides(name):
    problem, dims = PROBLEMS[name], TINY_DIMS[name]
    inputs = problem.make_inputs(BATCH, SEQ, seed=1, dims=dims)
    before = [(t.clone(), t.stride()) for t in tensors(inputs)]
    got = problem.run_reference(inputs, dims=dims)
    for t, (copy, stride) in zip(tensors(inputs), before):
        assert torch.equal(t, copy) and t.stride() == stride
    contiguous = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in inputs]
    for a, b in zip(got, problem.run_reference(contiguous, dims=dims)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---- the benchmark-style reference and the exact evaluation -------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("consistent", [False, True])
def test_reference_in_declared_dtypes_exact_in_float64(name, consistent):
    problem, dims = PROBLEMS[name], TINY_DIMS[name]
    inputs = problem.make_inputs(BATCH, SEQ, seed=2, dims=dims, consistent=consistent)
    got = problem.run_reference(inputs, dims=dims)
    exact = problem.run_exact(inputs, dims=dims)
    shapes = declared_outputs(name, BATCH, SEQ, dims)
    for out_name, out, ex, dtype, shape in zip(problem.output_names, got, exact, problem.output_dtypes, shapes):
        assert out.dtype == dtype and tuple(out.shape) == shape, out_name
        assert ex.dtype == f64 and tuple(ex.shape) == shape, out_name
        assert torch.isfinite(ex).all() and ex.abs().max() > 0, out_name
        # the rounding of the contract as written, nothing more
        assert (out.double() - ex).norm() <= 0.02 * ex.norm(), out_name


def test_the_exact_evaluation_skips_the_contracts_bf16_marks():
    for name in ("qkv_qknorm_backward", "decoder_layer_backward"):
        problem, dims = PROBLEMS[name], TINY_DIMS[name]
        inputs = problem.make_inputs(BATCH, SEQ, seed=4, dims=dims)
        rounded = problem.run_reference(inputs, dims=dims)
        exact = problem.run_exact(inputs, dims=dims)
        assert not torch.equal(rounded[0].double(), exact[0].to(rounded[0].dtype).double()), name


def _rms_dx_from_normalized(g, weight, normalized, rstd):
    """semantics.md version 2's dx, written out: rstd * (gn - mean_H(gn * n) * n), gn = g * weight."""
    gn = g * weight
    return rstd * (gn - (gn * normalized).mean(-1, keepdim=True) * normalized)


def test_fused_residual_formula_on_independent_inputs():
    problem, dims = PROBLEMS["fused_residual_rmsnorm_backward"], TINY_DIMS["fused_residual_rmsnorm_backward"]
    grad_output, x, normalized, rstd, weight = problem.make_inputs(BATCH, SEQ, seed=5, dims=dims)
    got = problem.reference(grad_output, x, normalized, rstd, weight)
    g = grad_output.float()
    dx = _rms_dx_from_normalized(g, weight, normalized, rstd)
    torch.testing.assert_close(got[0], dx.to(bf16), rtol=0, atol=0)
    torch.testing.assert_close(got[2], (g * normalized).sum((0, 1)), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], got[1]) and got[0] is not got[1]
    # x is not read when normalized is given ...
    assert all(torch.equal(a, b) for a, b in zip(got, problem.reference(grad_output, -x, normalized, rstd, weight)))
    # ... and normalized=None computes it as x * rstd.
    recomputed = problem.reference(grad_output, x, None, rstd, weight)
    given = problem.reference(grad_output, x, x * rstd, rstd, weight)
    for a, b in zip(recomputed, given):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(recomputed[2], got[2])


def test_qkv_norm_formula_on_independent_inputs():
    """dq = bf16(rstd * (gqn - mean(gqn * n) * n)), gqn = bf16(g * (1 + w)): checked through the
    weight gradient dq^T @ hidden, which the reference rounds once."""
    problem, dims = PROBLEMS["qkv_qknorm_backward"], TINY_DIMS["qkv_qknorm_backward"]
    inputs = list(problem.make_inputs(BATCH, SEQ, seed=6, dims=dims))
    names = dict(zip(problem.input_names, range(len(inputs))))
    inputs[names["q_norm_weight"]] = torch.randn(dims["head_dim"], generator=torch.Generator().manual_seed(1)).to(bf16)
    v = {n: inputs[i] for n, i in names.items()}
    got = problem.run_reference(inputs, dims=dims)
    g, n = v["grad_query"].float(), v["q_normed"].float()
    gqn = (g * (1 + v["q_norm_weight"].float())).to(bf16).float()
    dq = _rms_dx_from_normalized(gqn, 1.0, n, v["q_rstd"]).to(bf16)
    rows = dq.transpose(1, 2).reshape(BATCH * SEQ, -1)
    want = rows.T @ v["hidden_states"].reshape(BATCH * SEQ, -1)
    torch.testing.assert_close(got[1], want, rtol=0, atol=0)
    torch.testing.assert_close(got[4], (g * n).sum((0, 1, 2)), rtol=1e-6, atol=1e-6)
    # the transposed inputs are not read
    unread = list(inputs)
    unread[names["query_transposed"]] = unread[names["key_transposed"]] = None
    assert all(torch.equal(a, b) for a, b in zip(got, problem.run_reference(unread, dims=dims)))


# ---- 087: the scatter --------------------------------------------------------------------


def _embedding_dx(grad_output, hidden_states, rstd, norm_weight):
    """087's per-token dx in fp32, written out: xn = x * rstd, gn = g * w."""
    g = grad_output.float()
    return _rms_dx_from_normalized(g, norm_weight.float(), hidden_states * rstd, rstd).reshape(-1, g.shape[-1])


def test_embedding_formula_duplicate_ids_sum_in_fp32_and_round_once():
    dims = {"vocab": 512, "hidden": 16}
    grad_output, _, hidden_states, rstd, norm_weight = embedding_rmsnorm.make_inputs(4, 16, seed=6, dims=dims)
    run = embedding_rmsnorm.embedding_rmsnorm_backward
    per_token = _embedding_dx(grad_output, hidden_states, rstd, norm_weight)
    own_rows = torch.arange(64).view(4, 16)
    table, grad_norm_weight = run(grad_output, own_rows, hidden_states, rstd, norm_weight, vocab_size=512)
    assert torch.equal(table[:64], per_token.to(bf16)) and (table[64:] == 0).all()
    xn = (hidden_states * rstd).reshape(-1, 16)
    assert grad_norm_weight.dtype == bf16
    torch.testing.assert_close(grad_norm_weight, (grad_output.float().reshape(-1, 16) * xn).sum(0).to(bf16),
                               rtol=0.01, atol=0)
    same = torch.full((4, 16), 7, dtype=torch.int64)
    table = run(grad_output, same, hidden_states, rstd, norm_weight, vocab_size=512)[0]
    assert table.dtype == bf16
    assert torch.equal(table[7], per_token.double().sum(0).to(bf16))
    assert (table[:7] == 0).all() and (table[8:] == 0).all()
    # Accumulating in bf16 would give something else: the test can tell the two apart.
    in_bf16 = torch.zeros(16, dtype=bf16)
    for row in per_token:
        in_bf16 = (in_bf16.float() + row).to(bf16)
    assert not torch.equal(in_bf16, table[7])
    # An fp32 norm_weight gives an fp32 grad_norm_weight.
    fp32_weight = run(grad_output, same, hidden_states, rstd, norm_weight.float(), vocab_size=512)[1]
    assert fp32_weight.dtype == fp32


def test_embedding_ids_int32_range_and_accumulate():
    dims = TINY_DIMS["embedding_rmsnorm_backward"]
    grad_output, ids, hidden_states, rstd, norm_weight = embedding_rmsnorm.make_inputs(BATCH, SEQ, seed=7, dims=dims)
    run = embedding_rmsnorm.embedding_rmsnorm_backward
    table, grad_weight = run(grad_output, ids, hidden_states, rstd, norm_weight, vocab_size=12)
    table32, grad_weight32 = run(grad_output, ids.int(), hidden_states, rstd, norm_weight, vocab_size=12)
    assert torch.equal(table, table32) and torch.equal(grad_weight, grad_weight32)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[ids.flatten()] = False
    assert untouched.any() and (table[untouched] == 0).all() and (table[~untouched] != 0).any()

    for bad in (12, -1):
        wrong = ids.clone()
        wrong[0, 0] = bad
        with pytest.raises(ValueError, match="input_ids"):
            run(grad_output, wrong, hidden_states, rstd, norm_weight, vocab_size=12)

    existing = torch.randn(12, 16, generator=torch.Generator().manual_seed(0)).to(bf16)
    kept = existing.clone()
    fp32_rows = torch.zeros(12, 16).index_add_(0, ids.flatten(), _embedding_dx(grad_output, hidden_states, rstd,
                                                                                norm_weight))
    added = run(grad_output, ids, hidden_states, rstd, norm_weight, vocab_size=12, accumulate_into=existing)[0]
    assert torch.equal(existing, kept)
    assert torch.equal(added, (existing.float() + fp32_rows).to(bf16))
    assert torch.equal(added[untouched], existing[untouched])


def test_embedding_generator_ids():
    dims = {"vocab": 50, "hidden": 8}
    ids = embedding_rmsnorm.make_inputs(8, 64, seed=8, dims=dims)[1]
    assert ids.dtype == torch.int64 and ids.min() >= 0 and ids.max() < 50
    assert ids.unique().numel() > 40  # uniform over the vocabulary, not a handful of ids
    for consistent in (False, True):
        same = embedding_rmsnorm.make_inputs(
            2, 8, seed=8, dims=dims, consistent=consistent, same_ids=True, ids_dtype=torch.int32
        )[1]
        assert same.dtype == torch.int32 and same.unique().numel() == 1 and 0 <= same[0, 0] < 50


# ---- the input generators -------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("consistent", [False, True])
def test_generator_shapes_dtypes_and_data(name, consistent):
    problem, dims = PROBLEMS[name], TINY_DIMS[name]
    inputs = problem.make_inputs(BATCH, SEQ, seed=9, dims=dims, consistent=consistent)
    expected = declared_inputs(name, BATCH, SEQ, {**problem.dims, **dims})
    assert list(expected) == list(problem.input_names)
    for input_name, value, spec in zip(problem.input_names, inputs, expected.values(), strict=True):
        if spec is float:
            assert isinstance(value, float) and 0 < value < 1e-3, input_name
            continue
        shape, dtype = spec
        assert tuple(value.shape) == shape and value.dtype == dtype, input_name
        if value.is_floating_point():
            assert torch.isfinite(value).all(), input_name
        if input_name.endswith("norm_weight") and name == "qkv_qknorm_backward" and not consistent:
            assert (value == 1).all(), input_name  # the benchmark's all-ones norm weights
        elif value.is_floating_point() and input_name not in ("cos", "sin"):  # RoPE: its own test
            # Random data, not zeros or a few distinct values.
            assert value.unique().numel() >= min(value.numel() // 4, 256), input_name
    again = problem.make_inputs(BATCH, SEQ, seed=9, dims=dims, consistent=consistent)
    other = problem.make_inputs(BATCH, SEQ, seed=10, dims=dims, consistent=consistent)
    assert all(torch.equal(a, b) for a, b in zip(tensors(inputs), tensors(again)))
    assert not torch.equal(tensors(inputs)[0], tensors(other)[0])


def test_generators_follow_the_benchmarks_rules():
    """semantics.md version 2: rstd abs(randn) + 0.1 (013, 051), rsqrt(U[0.1, 2.1) + 1e-6) (087),
    2-D weights randn / sqrt(in); 056 from a forward pass with its own draws."""
    rstd = fused_residual_rmsnorm.make_inputs(8, 64, seed=11, dims={"hidden": 64})[3]
    assert rstd.min() >= 0.1 and 0.7 < rstd.mean() < 1.1  # E|randn| + 0.1 = 0.898
    rstd = embedding_rmsnorm.make_inputs(8, 64, seed=11, dims={"vocab": 50, "hidden": 8})[3]
    assert (rstd <= 0.1**-0.5 + 1e-3).all() and (rstd >= 2.1**-0.5 - 1e-3).all()
    q_weight = named_inputs(qkv_qknorm, 1, 4, seed=11)["q_weight"].float()
    assert 0.9 < q_weight.std() * 640**0.5 < 1.1

    dims = TINY_DIMS["decoder_layer_backward"]
    inputs = named_inputs(decoder_layer, BATCH, 8, seed=11, dims=dims)
    assert 0.015 < inputs["residual"].float().std() < 0.025
    for name in ("input_ln_weight", "post_attn_ln_weight"):
        assert (inputs[name].float() - 1).abs().max() < 0.15, name
    assert 0.9 < inputs["down_weight"].float().std() * (dims["intermediate"] / 2) ** 0.5 < 1.1
    for name in ("variance1", "variance2"):
        assert (inputs[name] > 0).all(), name
    weights = inputs["attn_weights"].float()
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), rtol=0, atol=2e-2)
    cos, sin = inputs["cos"].float(), inputs["sin"].float()
    half = dims["head_dim"] // 2
    assert torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos), rtol=0, atol=2e-2)
    assert (cos[:, 0] == 1).all() and (sin[:, 0] == 0).all()  # positions 0..s-1
    assert not torch.equal(cos[:, 1], cos[:, 0])


@pytest.mark.parametrize("consistent", [False, True])
def test_decoder_layer_head_inputs_are_transposed_views(consistent):
    dims = TINY_DIMS["decoder_layer_backward"]
    inputs = named_inputs(decoder_layer, BATCH, SEQ, seed=12, dims=dims, consistent=consistent)
    for name in ("query_states", "key_states", "value_states", "query_states_rotated"):
        view = inputs[name]
        assert view._base is not None and not view.is_contiguous(), name
        assert view.transpose(1, 2).is_contiguous(), name  # the storage is [b, s, heads, d]
    for name in ("key_states_repeated", "value_states_repeated", "attn_weights", "residual"):
        assert inputs[name].is_contiguous(), name


def test_consistent_inputs_are_the_forward_pass():
    # Spot checks that consistent=True really is one forward pass, in the benchmark dtypes.
    dims = TINY_DIMS["qkv_qknorm_backward"]
    inputs = named_inputs(qkv_qknorm, BATCH, SEQ, seed=13, dims=dims, consistent=True)
    q = inputs["query_transposed"].float()
    torch.testing.assert_close(inputs["q_normed"].float(), q * inputs["q_rstd"], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(
        inputs["q_rstd"], torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + qkv_qknorm.EPS), rtol=1e-5, atol=0
    )
    dims = TINY_DIMS["decoder_layer_backward"]
    inputs = named_inputs(decoder_layer, BATCH, SEQ, seed=13, dims=dims, consistent=True)
    group = dims["q_heads"] // dims["kv_heads"]
    assert torch.equal(inputs["key_states_repeated"], inputs["key_states_rotated"].repeat_interleave(group, 1))
    assert torch.equal(inputs["value_states_repeated"], inputs["value_states"].repeat_interleave(group, 1))
    assert (inputs["attn_weights"][..., 0, 1:] == 0).all()  # causal: the first token sees itself only


def test_real_dims_generators():
    for name in ("fused_residual_rmsnorm_backward", "qkv_qknorm_backward"):
        problem = PROBLEMS[name]
        inputs = problem.make_inputs(1, 3, seed=0)
        expected = declared_inputs(name, 1, 3, problem.dims)
        for value, spec in zip(inputs, expected.values()):
            if spec is not float:
                assert (tuple(value.shape), value.dtype) == spec
        got = problem.run_reference(inputs)
        assert [o.dtype for o in got] == list(problem.output_dtypes)
        assert [tuple(o.shape) for o in got] == declared_outputs(name, 1, 3, problem.dims)


# ---- speed-of-light counts ------------------------------------------------------------------


def mean_sol(name, **options):
    problem = PROBLEMS[name]
    return sum(sol_seconds(problem.cost(b, s, **options)) for s, b in WORKLOADS[name]) / len(WORKLOADS[name])


@pytest.mark.parametrize(
    "name, options, seconds",
    [
        ("fused_residual_rmsnorm_backward", {}, SOL_013),
        ("embedding_rmsnorm_backward", {}, SOL_087),
        ("qkv_qknorm_backward", {}, SOL_051),
        ("decoder_layer_backward", {}, SOL_056),
    ],
)
def test_sol_means_match_the_quoted_figures(name, options, seconds):
    assert mean_sol(name, **options) == pytest.approx(seconds, rel=0.01)


def test_workload_lists():
    assert {n: len(w) for n, w in WORKLOADS.items()} == {
        "fused_residual_rmsnorm_backward": 16, "embedding_rmsnorm_backward": 16,
        "qkv_qknorm_backward": 16, "decoder_layer_backward": 16,
    }  # fmt: skip
    assert len(set(WORKLOADS["decoder_layer_backward"])) == 16
    # 013's largest moves 10 bytes an element (semantics.md): 13.4 GB.
    assert fused_residual_rmsnorm_cost(64, 8192)[0] == pytest.approx(64 * 8192 * 2560 * 10, rel=1e-3)
    assert all(len(ATOL[name]) == len(WORKLOADS[name]) for name in WORKLOADS)
    assert atol("qkv_qknorm_backward", 128, 64) == 0.028 and atol("decoder_layer_backward", 128, 1) == 8.1
    assert atol("fused_residual_rmsnorm_backward", 8000, 64) == 7e-4  # the nearest workload's
    assert [o for _, _, o in cases("embedding_rmsnorm_backward") if o] == [{"same_ids": True}]


@pytest.mark.parametrize("name", NAMES)
def test_cost_counts_the_tensors_the_reference_touches(name):
    """bytes: the generated inputs the formula reads plus the outputs; flops: the reference's products."""
    problem, dims = PROBLEMS[name], TINY_DIMS[name]
    inputs = problem.make_inputs(BATCH, SEQ, seed=14, dims=dims)
    unread = getattr(problem.module, "UNREAD_INPUTS", ())
    read = sum(
        t.numel() * t.element_size()
        for n, t in zip(problem.input_names, inputs)
        if n not in unread and isinstance(t, torch.Tensor)
    )
    with FlopCounterMode(display=False) as counter:
        outputs = problem.run_reference(inputs, dims=dims)
    written = sum(o.numel() * o.element_size() for o in outputs)
    assert problem.cost(BATCH, SEQ, dims) == (read + written, counter.get_total_flops())
    if name == "decoder_layer_backward":
        assert counter.get_total_flops() > 0 and len(unread) == 4


def test_cost_options_of_the_embedding_problem():
    dims = TINY_DIMS["embedding_rmsnorm_backward"]
    grad_output, ids, hidden_states, rstd, weight = embedding_rmsnorm.make_inputs(BATCH, SEQ, seed=15, dims=dims)
    inputs_bytes = sum(t.numel() * t.element_size() for t in (grad_output, ids, hidden_states, rstd, weight))
    assert weight.dtype == bf16
    distinct = ids.unique().numel()
    assert distinct < BATCH * SEQ  # duplicates, so the distinct count matters
    touched_rows = 2 * distinct * dims["hidden"] * 2  # read and written, bf16
    assert embedding_rmsnorm_cost(BATCH, SEQ, dims, accumulate=True, distinct_ids=distinct) == (
        inputs_bytes + touched_rows + dims["hidden"] * 2,
        0,
    )
    default_distinct = embedding_rmsnorm_cost(BATCH, SEQ, dims, accumulate=True)[0]
    every_token_distinct = 2 * min(BATCH * SEQ, dims["vocab"]) * dims["hidden"] * 2
    assert default_distinct == inputs_bytes + every_token_distinct + dims["hidden"] * 2
    int32 = embedding_rmsnorm_cost(BATCH, SEQ, dims, ids_bytes=4)[0]
    assert embedding_rmsnorm_cost(BATCH, SEQ, dims)[0] - int32 == 4 * BATCH * SEQ
