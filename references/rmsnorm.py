"""The RMSNorm input gradient shared by all four problems, and the dtype rules of the references.

Every reference computes in fp32 (the contract's "all math is fp32"), or in float64 when its
floating inputs are float64, so the CPU autograd tests can check the formulas without
rounding noise. The contract's bf16(..) marks go through `round_bf16`, switchable so the
same tests can compare against autograd exactly.
"""

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any floating input is float64 (autograd checks), else fp32."""
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def round_bf16(t: torch.Tensor, enabled: bool) -> torch.Tensor:
    """The contract's intermediate bf16(..): round to nearest bf16, keep computing in t's dtype."""
    return t.to(torch.bfloat16).to(t.dtype) if enabled else t


def rms_dx(gn: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Gradient of x * rstd(x) per row of the last dim, given gn = d(loss)/d(normalized) * scale.

    rstd * gn - x * rstd^3 * (sum_j gn_j x_j) / H; rstd has a trailing dim of 1.
    """
    width = x.shape[-1]
    return rstd * gn - x * rstd.pow(3) * (gn * x).sum(-1, keepdim=True) / width


def finish(outputs, declared_dtypes, fp32_outputs: bool) -> tuple:
    """Cast outputs to their declared dtypes, the last rounding of the contract.

    Skipped for the parity harness's "reference in fp32" (fp32_outputs=True) and when the
    math ran in float64 (the autograd tests want the unrounded values back).
    """
    return tuple(
        out if fp32_outputs or out.dtype == torch.float64 else out.to(dtype)
        for out, dtype in zip(outputs, declared_dtypes, strict=True)
    )
