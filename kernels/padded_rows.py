"""Rows of bf16 copied into rows whose stride TMA can step (a multiple of 16 bytes).

The decoder layer's attention probabilities P [b, heads, s, s] at a sequence length that is not
a multiple of 8 have rows TMA cannot step, so the layer copies them into padded rows first.
PyTorch's strided copy moves such rows 2 bytes at a time (1.7 TB/s on the H200, 2.2x a
contiguous clone of the same bytes). Here each thread writes one 16-byte piece of a padded row
(aligned, since the padded stride is a multiple of 8 elements) and gathers its 8 elements from
the unaligned source row with 2-byte loads: a warp's 32 pieces are one contiguous stretch of the
source, so its loads share sectors and DRAM sees each byte once. The padding past a row's end is
written with zeros up to the next 8-element boundary (the buffer has it; nothing reads it).
Measured on the H200, ms (PyTorch's copy_ / this / a contiguous clone of the source): 449 x 16
0.238 / 0.117 / 0.104, 373 x 8 0.086 / 0.045 / 0.041, 613 x 1 0.031 / 0.019 / 0.017. At 211 x 2
(11 MB) a tight loop of calls is host-bound, 0.009 / 0.016: this call's checks cost more than
PyTorch's, which the layer hides (its host runs ahead of the GPU there).
"""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16

from . import runtime
from .checks import check_same_device, check_tensor

PIECE = 8  # bf16 elements in 16 bytes
THREADS = 256


class PaddedRows:
    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, stream):
        rows, width = src.shape
        pieces = rows * cute.ceil_div(width, PIECE)
        self.kernel(src, dst).launch(grid=[cute.ceil_div(pieces, THREADS), 1, 1], block=[THREADS, 1, 1],
                                     stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor):
        # A programmatic dependent launch (as the RMSNorm row kernel): CTAs take their SMs as the
        # kernel before retires and wait here, before any global access, for its writes.
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rows, width = src.shape
        per_row = (width + (PIECE - 1)) // PIECE
        piece = bidx * THREADS + tidx
        row = piece // per_row
        column = (piece - row * per_row) * PIECE
        if row < rows:
            values = cute.make_rmem_tensor((PIECE,), BFloat16)
            for j in cutlass.range_constexpr(PIECE):
                values[j] = BFloat16(0.0)
                if column + j < width:
                    values[j] = src[row, column + j]
            # the padded row as whole 16-byte pieces (its stride is a multiple of PIECE)
            padded = cute.make_tensor(dst[row, None].iterator, cute.make_layout((per_row * PIECE,)))
            store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            cute.copy(store, values, cute.zipped_divide(padded, (PIECE,))[None, column // PIECE])


def _build(arch: str, dump_dir=None):
    rows, width = cute.sym_int32(), cute.sym_int32()
    src = runtime.fake_tensor(BFloat16, (rows, width), (cute.sym_int64(), 1), 2)
    dst = runtime.fake_tensor(BFloat16, (rows, width), (cute.sym_int64(divisibility=PIECE), 1), 16)
    return runtime.compile_kernel(("padded_rows",), PaddedRows(), src, dst, runtime.env_stream(), arch=arch,
                                  dump_dir=dump_dir, tvm_ffi=True)


@functools.lru_cache(maxsize=None)
def _function(arch: str):
    """The build's C entry point, looked up once per arch (making the fake arguments that key
    the compile cache costs tens of us)."""
    return runtime.ffi_function(_build(arch))


def copy_padded_rows(src, dst):
    """dst[..., :] = src for bf16 CUDA tensors of one shape [..., W]: src's rows contiguous, the
    leading dimensions flattening to rows; dst's rows 16-byte aligned with a stride of at least
    W rounded up to 8 elements (a multiple of 8), which the copy fills with zeros past W.
    Returns dst."""
    check_tensor("src", src, dtypes=torch.bfloat16, contiguous=False, align=2)
    check_tensor("dst", dst, dtypes=torch.bfloat16, shape=tuple(src.shape), contiguous=False)
    check_same_device(src=src, dst=dst)
    width = src.shape[-1]
    rows = src.numel() // max(width, 1)
    try:
        src2, dst2 = src.view(rows, width), dst.view(rows, width)
    except RuntimeError:
        raise ValueError(f"src, dst: the leading dimensions must flatten to rows (strides {src.stride()}, "
                         f"{dst.stride()})") from None
    stride = dst2.stride(0)
    if src2.stride(1) != 1 or dst2.stride(1) != 1 or stride % PIECE or stride < -(-width // PIECE) * PIECE:
        raise ValueError(f"dst: rows 16-byte aligned, strides a multiple of {PIECE} of at least the width rounded "
                         f"up to it, unit column strides; got dst strides {dst.stride()}, src {src.stride()}")
    if rows * stride >= 2**31:
        raise ValueError(f"dst: {rows * stride} elements with padding; this kernel indexes with 32-bit offsets")
    if rows and width:
        _function(runtime.device_arch(src.device.index))(src2, dst2)
    return dst


AUDIT_BUILDS = {"padded_rows[bf16]": lambda arch, dump_dir: _build(arch, dump_dir)}
# 16-byte stores of the padded rows, nothing spilled
AUDIT_EXPECTS = {arch: {"require": ["STG.128"], "forbid": ["LOCAL"]} for arch in runtime.ARCHES}
