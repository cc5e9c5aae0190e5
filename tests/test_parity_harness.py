"""The parity harness itself must fail on what the correctness bar rejects."""
import torch

from cutebwd.tools.parity import check_output, poisoned_like


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


def test_poisoned_buffers():
    assert torch.isnan(poisoned_like(torch.zeros(4))).all()
    assert (poisoned_like(torch.zeros(4, dtype=torch.int32)) == 2**31 - 1).all()
