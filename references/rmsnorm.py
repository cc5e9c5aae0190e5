"""How a reference evaluates the contract, and the RMSNorm input gradient the problems share.

Every reference runs in one of two ways (semantics.md version 2, "Our correctness bar"):

- as written (`exact=False`, the benchmark-style reference): elementwise math in fp32 (056:
  in bf16, as PyTorch runs it on bf16 tensors), every bf16(..) of the contract rounded, every
  `@` between bf16 operands a bf16 product (fp32 accumulation, rounded to bf16 once), outputs
  cast to their declared dtypes;
- exact (`exact=True`): float64 throughout, no intermediate rounding, float64 outputs. The
  accuracy half of the bar measures kernels and the benchmark-style reference against it.
"""

import torch

bf16, f64 = torch.bfloat16, torch.float64


class Evaluation:
    """The arithmetic of one reference call: `exact`, or as written with `elementwise` the dtype
    bf16 inputs are computed in (fp32 where the contract says "math is float32")."""

    def __init__(self, exact: bool, elementwise: torch.dtype = torch.float32):
        self.exact = exact
        self.dtype = f64 if exact else elementwise

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """An input in the compute dtype: float64 when exact, else bf16 inputs in `elementwise`
        and wider ones as given (PyTorch's type promotion does the rest)."""
        return t.to(self.dtype) if self.exact or t.dtype == bf16 else t

    def bf16(self, t: torch.Tensor) -> torch.Tensor:
        """The contract's bf16(..): round to nearest bf16, then compute on in the elementwise dtype."""
        return t if self.exact else t.to(bf16).to(self.dtype)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The contract's `@`: a bf16 product with fp32 accumulation, rounded to bf16 once."""
        if self.exact:
            return a.to(f64) @ b.to(f64)
        return (a.to(bf16) @ b.to(bf16)).to(self.dtype)

    def finish(self, outputs, declared_dtypes) -> tuple:
        """Outputs in their declared dtypes (the contract's last rounding), or float64 when exact."""
        return tuple(out.to(f64 if self.exact else dtype) for out, dtype in zip(outputs, declared_dtypes, strict=True))


def rms_dx(gn: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Gradient of x * rstd(x) per row of the last dim, given gn = d(loss)/d(normalized) * scale:
    rstd * gn - x * rstd^3 * (sum_j gn_j x_j) / H; rstd has a trailing dim of 1."""
    width = x.shape[-1]
    return rstd * gn - x * rstd.pow(3) * (gn * x).sum(-1, keepdim=True) / width


def normalized_dx(gn: torch.Tensor, normalized: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The same gradient from the saved normalized row n = x * rstd (version 2's form):
    rstd * (gn - mean_H(gn * n) * n)."""
    return rstd * (gn - (gn * normalized).mean(-1, keepdim=True) * normalized)
