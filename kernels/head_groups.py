"""Sums over groups of attention heads: 056's dk and dv, whose per-query-head products are added
over each kv head's four query heads, straight into the [T, kv_heads * d] rows they belong to.

    into[b, g, i, :] = bf16(sum over t < group of fp32(per_head[b, g * group + t, i, :]))

Each thread makes one 16-byte piece of an output row: `group` 16-byte loads (one per head of
its group, contiguous across the warp within each head), an fp32 sum, one 16-byte store. PyTorch's
sum over the head dimension into the strided head view ran at about a third of copy bandwidth
(64 us at 449 x 16, where the bytes take ~22 us).
"""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from . import runtime
from .checks import check_same_device, check_tensor

PIECE = 8  # bf16 elements in 16 bytes
THREADS = 256


class HeadGroupSum:
    def __init__(self, group: int):
        self.group = group

    @cute.jit
    def __call__(self, per_head: cute.Tensor, into: cute.Tensor, stream):
        batch, groups, seq, width = into.shape
        pieces = batch * groups * seq * (width // PIECE)
        self.kernel(per_head, into).launch(grid=[cute.ceil_div(pieces, THREADS), 1, 1], block=[THREADS, 1, 1],
                                           stream=stream)

    @cute.kernel
    def kernel(self, per_head: cute.Tensor, into: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        batch, groups, seq, width = into.shape
        per_row = width // PIECE
        piece = bidx * THREADS + tidx
        row = piece // per_row  # over (batch, group, position)
        column = piece - row * per_row
        pair = row // seq  # batch * groups + group
        position = row - pair * seq
        b = pair // groups
        if pair < batch * groups:
            wide = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            total = cute.make_rmem_tensor((PIECE,), Float32)
            total.fill(0.0)
            group = pair - b * groups
            for t in cutlass.range_constexpr(self.group):  # the loads are independent: all in flight at once
                head = cute.make_rmem_tensor((PIECE,), BFloat16)
                row_in = per_head[b, group * self.group + t, position, None]
                cute.copy(wide, cute.zipped_divide(row_in, (PIECE,))[None, column], head)
                total.store(total.load() + head.load().to(Float32))
            out = cute.make_rmem_tensor((PIECE,), BFloat16)
            out.store(total.load().to(BFloat16))
            cute.copy(wide, out, cute.zipped_divide(into[b, group, position, None], (PIECE,))[None, column])


def _build(group: int, arch: str, dump_dir=None):
    # batch, seq and width are one extent each for both tensors: the C entry point checks they match
    batch, heads, groups, seq, width = (cute.sym_int32() for _ in range(5))
    per_head, into = (runtime.fake_tensor(BFloat16, (batch, count, seq, width),
                                          (*(cute.sym_int64(divisibility=PIECE) for _ in range(3)), 1), 16)
                      for count in (heads, groups))
    return runtime.compile_kernel(("head_group_sum", group), HeadGroupSum(group), per_head, into,
                                  runtime.env_stream(), arch=arch, dump_dir=dump_dir, tvm_ffi=True)


@functools.lru_cache(maxsize=None)
def _function(group: int, arch: str):
    """The build's C entry point, looked up once per (group, arch): making the fake arguments
    that key the compile cache costs tens of us."""
    return runtime.ffi_function(_build(group, arch))


# (per_head's shape and strides, into's, device) -> the C entry point, after the full checks passed once
_ready: dict = {}


def sum_head_groups(per_head, into):
    """into[b, g] = the bf16 sum (in fp32) of per_head[b, g * r : (g + 1) * r] over its r heads,
    for bf16 CUDA tensors per_head [b, H, s, d] (contiguous) and into [b, H / r, s, d] (any
    strides that are multiples of 8 with a contiguous last dimension, e.g. the head view of
    [b * s, kv_heads * d] rows); d a multiple of 8. Returns into. Host cost after a layout's
    first call: one dict lookup and the C call (which checks dtypes, extents and alignment)."""
    try:
        function = _ready[per_head.shape, per_head.stride(), into.shape, into.stride(), per_head.get_device()]
    except (AttributeError, KeyError, TypeError):
        function = _prepare(per_head, into)
        _ready[per_head.shape, per_head.stride(), into.shape, into.stride(), per_head.get_device()] = function
    if into.numel():
        try:
            function(per_head, into)
        except Exception:
            _prepare(per_head, into)  # the C checks refused an argument: say which, in our words
            raise
    return into


def _prepare(per_head, into):
    """The full checks, then the build's C entry point for r = H / groups."""
    import torch

    check_tensor("per_head", per_head, dtypes=torch.bfloat16, ndim=4)
    check_tensor("into", into, dtypes=torch.bfloat16, ndim=4, contiguous=False)
    check_same_device(per_head=per_head, into=into)
    (batch, heads, seq, width), groups = per_head.shape, into.shape[1]
    if not groups or heads % groups or tuple(into.shape) != (batch, groups, seq, width):
        raise ValueError(f"into: expected [{batch}, a divisor of {heads}, {seq}, {width}], got {list(into.shape)}")
    if width % PIECE or into.stride(3) != 1 or any(into.stride(i) % PIECE for i in range(3)):
        raise ValueError(f"into: head width {width} and strides {into.stride()} must be multiples of {PIECE} "
                         f"(16 bytes) with a contiguous last dimension")
    if per_head.numel() >= 2**31:
        raise ValueError(f"per_head: {per_head.numel()} elements; this kernel indexes with 32-bit offsets")
    return _function(heads // groups, runtime.device_arch(per_head.device.index))


AUDIT_BUILDS = {"head_group_sum[4 heads]": lambda arch, dump_dir: _build(4, arch, dump_dir)}
# 16-byte loads and stores, nothing spilled
AUDIT_EXPECTS = {arch: {"require": ["LDG.128", "STG.128"], "forbid": ["LOCAL"]} for arch in runtime.ARCHES}
