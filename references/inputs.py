"""Random tensors for the input generators: one seeded generator per call, on the target device.

The benchmark's "random" problems (013, 051) draw independent tensors by name (semantics.md
version 2): randn, except rstd `abs(randn) + 0.1`, norm weights all ones and 2-D weight
matrices `randn / sqrt(in_features)`. 087 and 056 have their own generators. Data is never
zeros or a few distinct values, except the all-ones norm weights the benchmark itself uses
(tensor cores run faster on low-entropy data, and the timings would flatter).
"""

import torch


class InputDraw:
    """Draws for one make_inputs call.

    dtype=None gives every floating tensor its declared dtype (the benchmark's); a dtype
    (e.g. torch.float64 for the autograd tests) replaces all of them. Draws are made on
    `device` so large workloads generate fast on the GPU; a seed repeats exactly on one
    device kind.
    """

    def __init__(self, seed: int, device="cpu", dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.dtype = dtype
        # Forward passes run in fp32 like the model's norms and softmax, float64 if asked.
        self.compute = torch.float64 if dtype == torch.float64 else torch.float32

    def cast(self, t: torch.Tensor, declared: torch.dtype) -> torch.Tensor:
        return as_dtype(t, declared, self.dtype)

    def randn(self, shape, declared: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(shape, generator=self.generator, device=self.device, dtype=self.compute)
        return self.cast(t * scale, declared)

    def linear_weight(self, out_features: int, in_features: int, declared: torch.dtype):
        """nn.Linear-sized weights (std 1/sqrt(in)), so activations stay O(1) through products."""
        return self.randn((out_features, in_features), declared, scale=in_features**-0.5)

    def rstd(self, shape, declared: torch.dtype) -> torch.Tensor:
        """The benchmark's rstd of a "random" problem: abs(randn) + 0.1."""
        t = torch.randn(shape, generator=self.generator, device=self.device, dtype=self.compute)
        return self.cast(t.abs() + 0.1, declared)

    def uniform(self, shape, low: float, high: float) -> torch.Tensor:
        """Uniform in [low, high), in the compute dtype."""
        t = torch.rand(shape, generator=self.generator, device=self.device, dtype=self.compute)
        return low + (high - low) * t

    def ones(self, shape, declared: torch.dtype) -> torch.Tensor:
        return self.cast(torch.ones(shape, device=self.device, dtype=self.compute), declared)

    def randint(self, high: int, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.generator, device=self.device, dtype=dtype)

    def rope_tables(self, batch: int, seq: int, head_dim: int, theta: float, declared: torch.dtype,
                    from_zero: bool = False):
        """cos, sin [batch, seq, head_dim] with both halves equal, as HF rotary embeddings build them.

        Positions 0..seq-1 in every batch row with from_zero (the benchmark's tables); else each
        batch row starts at its own random position, so a kernel that reads the wrong batch row
        of the table gets different numbers.
        """
        start = torch.zeros((batch, 1), dtype=torch.int64, device=self.device) if from_zero else \
            self.randint(4096, (batch, 1), torch.int64)
        positions = (start + torch.arange(seq, device=self.device)).to(self.compute)
        exponent = torch.arange(0, head_dim, 2, device=self.device, dtype=self.compute) / head_dim
        inv_freq = 1.0 / theta**exponent
        angles = positions[..., None] * inv_freq  # [batch, seq, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)
        return self.cast(angles.cos(), declared), self.cast(angles.sin(), declared)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The forward passes' dtype: float64 when any floating input is float64 (autograd checks), else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def round_bf16(t: torch.Tensor, enabled: bool) -> torch.Tensor:
    """What a bf16 model stores: round to nearest bf16, keep computing in t's dtype."""
    return t.to(torch.bfloat16).to(t.dtype) if enabled else t


def rsqrt_mean_square(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd of the forward passes: rsqrt(mean(x^2) + eps) over the last dim."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def as_dtype(t: torch.Tensor, declared: torch.dtype, dtype: torch.dtype | None) -> torch.Tensor:
    """t in its declared dtype, or in `dtype` when one is asked for every floating tensor."""
    return t.to(declared if dtype is None else dtype)


def model_dims(defaults: dict, overrides: dict | None) -> dict:
    """The real model dimensions with some replaced (tests use tiny ones)."""
    return {**defaults, **(overrides or {})}
