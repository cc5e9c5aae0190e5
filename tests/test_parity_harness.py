"""The parity harness itself must fail on what the correctness bar (semantics.md version 2) rejects."""
import pytest
import torch

from cutebwd.tools import parity
from cutebwd.tools.parity import check_output, poisoned_like, preallocated

ATOL = 1e-5


def _exact(n=10_000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ref(exact):
    """A benchmark-style reference: the exact values rounded to bf16, as the contract's outputs are."""
    return exact.to(torch.bfloat16)


def test_the_reference_itself_passes():
    exact = _exact()
    assert check_output("x", _ref(exact), _ref(exact), ATOL, exact).ok


def test_a_more_accurate_output_passes():
    exact = _exact()
    assert check_output("x", exact.float(), _ref(exact), ATOL, exact).ok


def test_nan_or_inf_anywhere_fails():
    exact = _exact()
    for bad in (float("nan"), float("inf")):
        out = _ref(exact).clone()
        out[123] = bad
        report = check_output("x", out, _ref(exact), ATOL, exact)
        assert report.nonfinite == 1 and not report.ok
    ref = _ref(exact).clone()
    ref[7] = float("nan")  # the benchmark fails a non-finite reference too
    assert not check_output("x", ref.clone(), ref, ATOL, exact).ok


def test_two_percent_wrong_elements_fail_the_benchmark_rule():
    exact = _exact()
    out = _ref(exact).clone()
    out[:200] += 1.0
    report = check_output("x", out, _ref(exact), ATOL, exact)
    assert report.close_fraction < 0.99 and not report.benchmark_ok and not report.ok


def test_rtol_is_five_percent_and_atol_is_the_workloads():
    exact = _exact()
    ref = exact.float()
    assert check_output("x", ref * 1.04, ref, ATOL).benchmark_ok
    assert not check_output("x", ref * 1.06, ref, ATOL).benchmark_ok
    shifted = ref + 0.5
    assert check_output("x", shifted, ref, atol=1.0).benchmark_ok and not check_output("x", shifted, ref, ATOL).ok


def test_all_zero_output_fails_against_a_nonzero_reference():
    ref = torch.full((100,), 1e-6)  # within atol of zero everywhere
    report = check_output("x", torch.zeros(100), ref, ATOL)
    assert report.close_fraction == 1.0 and report.all_zero and not report.ok
    assert check_output("x", torch.zeros(100), torch.zeros(100), ATOL).ok


def test_accuracy_against_the_exact_evaluation():
    """Within the benchmark's rule but twice as far from the exact values as the reference is: fails."""
    exact = _exact()
    ref = _ref(exact)
    noise = (ref.double() - exact) * 3  # three times the reference's own error
    out = (exact + noise).float()
    report = check_output("x", out, ref, ATOL, exact)
    assert report.benchmark_ok and not report.accuracy_ok and not report.ok
    assert report.error == pytest.approx(3 * report.ref_error, rel=1e-6)


def test_poisoned_and_zero_buffers():
    assert torch.isnan(poisoned_like(torch.zeros(4))).all()
    assert (poisoned_like(torch.zeros(4, dtype=torch.int32)) == 2**31 - 1).all()
    nan, zeros = preallocated([torch.ones(3, dtype=torch.bfloat16)], "nan")[0], \
        preallocated([torch.ones(3, dtype=torch.bfloat16)], "zeros")[0]
    assert nan.dtype == zeros.dtype == torch.bfloat16 and torch.isnan(nan).all() and (zeros == 0).all()
    with pytest.raises(ValueError, match="fill"):
        preallocated([torch.ones(3)], "ones")


@pytest.mark.parametrize("fill", parity.FILLS)
def test_check_problem_catches_an_unwritten_output(fill):
    """check_problem hands over preallocated outputs; a kernel that skips one fails."""
    from cutebwd.references import PROBLEMS

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
        out[1].fill_(float("nan")) if fill == "nan" else out[1].zero_()

    assert all(r.ok for r in parity.check_problem(cpu_problem, honest, 2, 5, dims=dims, fills=(fill,), rounds=2))
    with pytest.raises(AssertionError, match="grad_residual"):
        parity.check_problem(cpu_problem, lazy, 2, 5, dims=dims, fills=(fill,))


def test_an_exact_evaluation_with_nan_stops_the_check():
    """A NaN in the exact values would make the accuracy half read as not measured, and pass."""
    exact = _exact()
    ref = _ref(exact)
    exact[5] = float("nan")
    with pytest.raises(AssertionError, match="exact evaluation holds NaN"):
        check_output("x", ref.clone(), ref, ATOL, exact)


def test_assert_problem_holds_outputs_to_the_contracts_dtypes():
    """An output in a wider dtype than declared can meet the tolerances; the contract fixes the dtype."""
    from cutebwd.references import PROBLEMS

    problem = PROBLEMS["fused_residual_rmsnorm_backward"]
    dims = {"hidden": 64}
    inputs = problem.module.make_inputs(2, 5, dims=dims)
    outputs = problem.run_reference(inputs, dims=dims)
    assert all(r.ok for r in parity.assert_problem(problem, inputs, outputs, 2, 5, dims=dims))
    widened = (outputs[0].float(), *outputs[1:])
    with pytest.raises(AssertionError, match="grad_hidden_states is torch.float32, the contract's is torch.bfloat16"):
        parity.assert_problem(problem, inputs, widened, 2, 5, dims=dims)
