"""Row RMS statistic: rstd[r] = rsqrt(mean_j x[r, j]^2 + eps), the forward half of RMSNorm.

The foundation's small real kernel: it exercises compile-for-two-arches, the machine-code
audit and the GPU parity path end to end before the backward kernels exist.

Work split: one warp per row, four rows per 128-thread CTA; each lane reads 128-bit vectors
strided by the warp (coalesced), accumulates x^2 in fp32, and a butterfly shuffle reduces the
warp. The hidden size is static (one compile per hidden size and dtype); the row count is a
runtime argument, so any (batch, seq) reuses the same build.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from . import errors, runtime
from .checks import check_same_device, check_tensor

VECTOR_BITS = 128
ROWS_PER_CTA = 4


class RowRstd:
    def __init__(self, dtype, hidden: int):
        self.dtype = dtype
        self.hidden = hidden
        self.vector = VECTOR_BITS // dtype.width
        if hidden % self.vector:
            raise ValueError(f"hidden size {hidden} must be a multiple of {self.vector} for {dtype}")

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, rstd_ptr: cute.Pointer, rows: Int32, eps: Float32,
                 stream: cuda.CUstream):
        x = cute.make_tensor(x_ptr, cute.make_layout((rows, self.hidden), stride=(self.hidden, 1)))
        rstd = cute.make_tensor(rstd_ptr, cute.make_layout((rows,)))
        self.kernel(x, rstd, eps).launch(
            grid=[cute.ceil_div(rows, ROWS_PER_CTA), 1, 1], block=[32 * ROWS_PER_CTA, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, rstd: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * ROWS_PER_CTA + tidx // 32
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), x.element_type,
                                   num_bits_per_copy=VECTOR_BITS)
        if row < x.shape[0]:
            row_vectors = cute.zipped_divide(x[row, None], (self.vector,))  # (vector, n_vectors)
            values = cute.make_rmem_tensor((self.vector,), x.element_type)
            sum_sq = Float32(0.0)
            for v in cutlass.range(lane, self.hidden // self.vector, 32):
                cute.copy(load, row_vectors[None, v], values)
                f = values.load().to(Float32)
                sum_sq += (f * f).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            sum_sq = cute.arch.warp_reduction(sum_sq, lambda a, b: a + b)
            if lane == 0:
                rstd[row] = cute.math.rsqrt(sum_sq * (1.0 / self.hidden) + eps)


def _build(dtype, hidden: int, arch: str, dump_dir=None):
    kernel = RowRstd(dtype, hidden)
    return runtime.compile_kernel(
        ("row_rstd", dtype.__name__, hidden), kernel,
        runtime.fake_ptr(dtype), runtime.fake_ptr(Float32, 4), Int32(1), Float32(0.0),
        runtime.fake_stream(), arch=arch, dump_dir=dump_dir)


def rms_rstd(x, eps: float = 1e-6, *, out=None):
    """rsqrt(mean(x^2, -1) + eps) in fp32 for a CUDA tensor x[..., H] (bf16, fp16 or fp32).

    x must be contiguous, 16-byte aligned, with H a multiple of 16 bytes' worth of elements.
    Returns (or writes into `out`) an fp32 tensor of shape x.shape[:-1].
    """
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected a last (hidden) dimension of size > 0, got shape {list(x.shape)}")
    hidden = x.shape[-1]
    vector = VECTOR_BITS // (8 * x.element_size())
    if hidden % vector:
        raise ValueError(f"x: hidden size {hidden} must be a multiple of {vector} for {x.dtype}")
    rows = x.numel() // hidden
    if x.numel() >= 2**31:
        raise ValueError(f"x: {x.numel()} elements; this kernel indexes with 32-bit offsets (< 2^31)")
    if out is None:
        out = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    else:
        check_tensor("out", out, dtypes=torch.float32, shape=tuple(x.shape[:-1]), align=4)
        check_same_device(x=x, out=out)
    errors.raise_pending(x.get_device())
    if rows == 0:
        return out
    dtype = runtime.cute_dtype(x.dtype)
    compiled = _build(dtype, hidden, runtime.device_arch(x.device.index))
    compiled(runtime.gmem_ptr(x, dtype), runtime.gmem_ptr(out, Float32, 4), Int32(rows),
             Float32(eps), runtime.current_stream(x.device))
    return out


# What the audit compiles, and what each build's machine code must hold.
AUDIT_BUILDS = {
    f"row_rstd[{dt.__name__},H={h}]": (lambda arch, dump_dir, dt=dt, h=h: _build(dt, h, arch, dump_dir))
    for dt, h in ((cutlass.BFloat16, 2560), (Float32, 4096))
}
AUDIT_EXPECTS = {arch: {"require": ["LDG.128"], "forbid": ["LOCAL"]} for arch in runtime.ARCHES}
