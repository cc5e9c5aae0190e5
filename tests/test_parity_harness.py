"""The parity harness itself must fail on what the correctness bar rejects."""
import torch

from cutebwd.tools.parity import check_output, held, poisoned_like


def _ref(n=10_000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_exact_output_passes():
    ref = _ref()
    assert check_output("x", ref.clone(), ref, torch.bfloat16).ok


def test_bf16_rounding_passes_bf16_bar():
    ref = _ref()
    assert check_output("x", ref.bfloat16().float(), ref, torch.bfloat16).ok


def test_bf16_rounding_fails_fp32_reduction_bar():
    ref = _ref()
    report = check_output("x", ref.bfloat16().float(), ref, torch.float32)
    assert not report.ok and report.rel_frobenius > 1e-4


def test_unwritten_element_fails():
    ref = _ref()
    out = ref.clone()
    out[123] = float("nan")
    report = check_output("x", out, ref, torch.bfloat16)
    assert report.stray_nonfinite == 1 and not report.ok


def test_nan_where_reference_has_nan_passes():
    ref = _ref()
    ref[7] = float("nan")
    out = ref.clone()
    assert check_output("x", out, ref, torch.bfloat16).ok


def test_two_percent_wrong_elements_fail():
    ref = _ref()
    out = ref.clone()
    out[:200] += 1.0
    report = check_output("x", out, ref, torch.bfloat16)
    assert report.close_fraction < 0.99 and not report.ok


def test_small_uniform_bias_fails_frobenius():
    ref = _ref()
    report = check_output("x", ref * 1.02, ref, torch.bfloat16)
    assert not report.ok


def test_a_measured_level_holds_only_what_it_names():
    """An output held to a measured level (MEASURED_LEVEL) passes below the bar within that
    level and fails outside it, or with a stray NaN."""
    ref = _ref()
    out = ref.clone()
    out[:300] += 1.0  # 97% close
    report = check_output("x", out, ref, torch.bfloat16)
    assert not report.ok and not held(report)
    assert held(report, (0.96, 0.2)) and not held(report, (0.98, 0.2)) and not held(report, (0.96, 1e-3))
    out[5000] = float("nan")
    assert not held(check_output("x", out, ref, torch.bfloat16), (0.96, 0.2))


def test_poisoned_buffers():
    assert torch.isnan(poisoned_like(torch.zeros(4))).all()
    assert (poisoned_like(torch.zeros(4, dtype=torch.int32)) == 2**31 - 1).all()


def test_check_problem_catches_an_unwritten_output():
    """check_problem hands over poisoned outputs; a kernel that skips one fails."""
    import pytest

    from cutebwd.references import PROBLEMS
    from cutebwd.tools import parity

    problem = PROBLEMS["fused_residual_rmsnorm_backward"]
    dims = {"hidden": 64}

    def make_inputs(batch, seq, device, **kw):  # CPU stand-in for the GPU inputs
        return problem.module.make_inputs(batch, seq, **kw)

    cpu_problem = type(problem)(**{**problem.__dict__, "make_inputs": make_inputs})

    def honest(*inputs, out):
        for o, r in zip(out, cpu_problem.run_reference(inputs, dims=dims)):
            o.copy_(r)

    def lazy(*inputs, out):
        honest(*inputs, out=out)
        out[1].fill_(float("nan"))

    assert all(r.ok for r in parity.check_problem(cpu_problem, honest, 2, 5, dims=dims))
    with pytest.raises(AssertionError, match="grad_residual"):
        parity.check_problem(cpu_problem, lazy, 2, 5, dims=dims)
