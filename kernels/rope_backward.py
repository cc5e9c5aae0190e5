"""The rotary position embedding's backward for queries and keys, one launch.

transformers' forward (apply_rotary_pos_emb): y = x * cos + rotate_half(x) * sin per head, cos and
sin [b, s, d] shared by the heads, rotate_half(x) = (-x2, x1) for the halves x1, x2 of d. Its
gradient, with the halves of g, cos and sin likewise:

    g_x1 = g1 * cos1 + g2 * sin2        g_x2 = g2 * cos2 - g1 * sin1

Eager autograd takes about six launches a tensor (two multiplies, rotate_half's slice, negate and
concatenate backward, an add), twelve for queries and keys; here one kernel does both, in fp32
with one rounding. Each thread owns a piece: 8 elements of a row's first half and the 8 they pair
with in the second (16-byte loads and stores), so rows are read once and written once.
"""
from __future__ import annotations

import functools

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32

from . import runtime
from .checks import check_same_device, check_tensor

PIECE = 8  # bf16 elements in 16 bytes
THREADS = 256
MAX_HEAD_DIM = 1024


class RopeBackward:
    def __init__(self, head_dim: int):
        if head_dim % (2 * PIECE) or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be a multiple of {2 * PIECE} up to {MAX_HEAD_DIM}, got {head_dim}")
        self.head_dim = head_dim

    @cute.jit
    def __call__(self, grad_q: cute.Tensor, grad_k: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor,
                 dq: cute.Tensor, dk: cute.Tensor, stream):
        batch, q_heads, seq, _ = grad_q.shape
        rows = batch * seq * (q_heads + grad_k.shape[1])
        pieces = rows * (self.head_dim // (2 * PIECE))
        self.kernel(grad_q, grad_k, cos, sin, dq, dk).launch(
            grid=[cute.ceil_div(pieces, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, grad_q: cute.Tensor, grad_k: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor,
               dq: cute.Tensor, dk: cute.Tensor):
        # A programmatic dependent launch: the CTAs wait here, before any global access, for the
        # kernel before (the attention's backward) to finish writing the gradients.
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        batch, q_heads, seq, _ = grad_q.shape
        per_row = self.head_dim // (2 * PIECE)
        piece = bidx * THREADS + tidx
        row = piece // per_row
        column = piece - row * per_row  # the piece's vector in the first half
        q_rows = batch * q_heads * seq
        if row < q_rows:
            self.rotate_back(grad_q, cos, sin, dq, row, column)
        elif row < q_rows + batch * grad_k.shape[1] * seq:
            self.rotate_back(grad_k, cos, sin, dk, row - q_rows, column)

    @cute.jit
    def rotate_back(self, grad: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, out: cute.Tensor, row, column):
        """Row `row` of grad [b, heads, s, d] (b-major, then heads, then s), piece `column`."""
        _, heads, seq, _ = grad.shape
        s = row % seq
        b = row // (seq * heads)
        h = (row // seq) % heads
        half = self.head_dim // (2 * PIECE)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        loaded = [cute.make_rmem_tensor((PIECE,), BFloat16) for _ in range(6)]
        t = b % cos.shape[0]  # tables of batch 1 serve every batch (shared positions)
        sources = (grad[b, h, s, None], cos[t, s, None], sin[t, s, None])
        for i, source in enumerate(sources):
            pieces = cute.zipped_divide(source, (PIECE,))
            cute.copy(atom, pieces[None, column], loaded[2 * i])
            cute.copy(atom, pieces[None, column + half], loaded[2 * i + 1])
        g1, g2, c1, c2, s1, s2 = (t.load().to(Float32) for t in loaded)
        first, second = (cute.make_rmem_tensor((PIECE,), BFloat16) for _ in range(2))
        first.store((g1 * c1 + g2 * s2).to(BFloat16))
        second.store((g2 * c2 - g1 * s1).to(BFloat16))
        pieces = cute.zipped_divide(out[b, h, s, None], (PIECE,))
        cute.copy(atom, first, pieces[None, column])
        cute.copy(atom, second, pieces[None, column + half])


def _build(head_dim: int, arch: str, dump_dir=None):
    batch, seq = cute.sym_int32(), cute.sym_int32()

    def strides(count):  # free strides that keep rows 16-byte aligned, then a unit one
        return tuple(cute.sym_int64(divisibility=PIECE) for _ in range(count)) + (1,)

    def rows(heads):  # [b, heads, s, d] bf16
        return runtime.fake_tensor(BFloat16, (batch, heads, seq, head_dim), strides(3), 16)

    table_batch = cute.sym_int32()

    def table():  # cos, sin [b or 1, s, d]
        return runtime.fake_tensor(BFloat16, (table_batch, seq, head_dim), strides(2), 16)

    q_heads, kv_heads = cute.sym_int32(), cute.sym_int32()
    return runtime.compile_kernel(("rope_backward", head_dim), RopeBackward(head_dim), rows(q_heads), rows(kv_heads),
                                  table(), table(), rows(q_heads), rows(kv_heads), runtime.env_stream(), arch=arch,
                                  dump_dir=dump_dir, tvm_ffi=True)


@functools.lru_cache(maxsize=None)
def _function(head_dim: int, arch: str):
    return runtime.ffi_function(_build(head_dim, arch))


def kernel_takes(grad_q, grad_k, cos, sin) -> bool:
    """The part of kernel_reads that torch.compile can decide while it traces: bf16 CUDA tensors,
    [b, heads, s, d] gradients and [b or 1, s, d] tables, head_dim a multiple of 16 up to
    MAX_HEAD_DIM."""
    return (grad_q.dim() == grad_k.dim() == 4 and cos.dim() == sin.dim() == 3
            and _shapes_match(grad_q, grad_k, cos, sin)
            and grad_q.shape[-1] % (2 * PIECE) == 0 and grad_q.shape[-1] <= MAX_HEAD_DIM
            and all(t.is_cuda and t.dtype == torch.bfloat16 for t in (grad_q, grad_k, cos, sin)))


def kernel_reads(grad_q, grad_k, cos, sin) -> bool:
    """What the kernel takes: kernel_takes, and unit last strides, the others multiples of 8
    elements, 16-byte aligned bases, fewer than 2^31 elements each."""
    return kernel_takes(grad_q, grad_k, cos, sin) and all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(stride % PIECE == 0 for stride in t.stride()[:-1])
        and t.numel() < 2**31 for t in (grad_q, grad_k, cos, sin))


def _shapes_match(grad_q, grad_k, cos, sin) -> bool:
    """grad_q [b, heads, s, d] and grad_k [b, kv_heads, s, d]; cos and sin [b or 1, s, d]."""
    batch, _, seq, head_dim = grad_q.shape
    return ((grad_k.shape[0], grad_k.shape[2:]) == (batch, (seq, head_dim)) and cos.shape[0] in (1, batch)
            and cos.shape[1:] == (seq, head_dim) and sin.shape == cos.shape)


def rope_backward(grad_q, grad_k, cos, sin):
    """(dq, dk) of y = x * cos + rotate_half(x) * sin for queries and keys (module docstring):
    grad_q [b, q_heads, s, d], grad_k [b, kv_heads, s, d], cos and sin [b or 1, s, d], bf16 CUDA tensors
    as kernel_reads says; dq and dk come contiguous."""
    for name, t in (("grad_q", grad_q), ("grad_k", grad_k), ("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtypes=torch.bfloat16, contiguous=False)
    head_dim = grad_q.shape[-1]
    if grad_q.dim() != 4 or cos.dim() != 3 or not _shapes_match(grad_q, grad_k, cos, sin):
        raise ValueError(f"grad_q {list(grad_q.shape)}, grad_k {list(grad_k.shape)}, cos {list(cos.shape)}, sin "
                         f"{list(sin.shape)}: expected [b, heads, s, d] gradients and [b or 1, s, d] tables")
    if not kernel_reads(grad_q, grad_k, cos, sin):
        raise ValueError(f"rope_backward: head_dim a multiple of {2 * PIECE} up to {MAX_HEAD_DIM}, unit last strides, "
                         f"other strides multiples of {PIECE}, 16-byte aligned; got head_dim {head_dim}, strides "
                         f"{[t.stride() for t in (grad_q, grad_k, cos, sin)]}")
    return launch(grad_q, grad_k, cos, sin)


def launch(grad_q, grad_k, cos, sin, token_major: bool = False):
    """rope_backward on tensors kernel_reads has passed (the operator's call decides that first, so
    a call checks them once). dq and dk come contiguous, or with token_major [b, s, heads, d] in
    memory (the kernel writes through free strides, the same build)."""
    check_same_device(grad_q=grad_q, grad_k=grad_k, cos=cos, sin=sin)

    def result(grad):
        if token_major:
            batch, heads, seq, head_dim = grad.shape
            return grad.new_empty((batch, seq, heads, head_dim)).transpose(1, 2)
        return torch.empty_like(grad, memory_format=torch.contiguous_format)

    dq, dk = result(grad_q), result(grad_k)
    if grad_q.numel() + grad_k.numel():
        _function(grad_q.shape[-1], runtime.device_arch(grad_q.device.index))(grad_q, grad_k, cos, sin, dq, dk)
    return dq, dk


AUDIT_BUILDS = {f"rope_backward[d={d}]": (lambda arch, dump_dir, d=d: _build(d, arch, dump_dir)) for d in (128, 256)}
# 16-byte loads and stores, nothing spilled
AUDIT_EXPECTS = {arch: {"require": ["LDG.128", "STG.128"], "forbid": ["LOCAL"]} for arch in runtime.ARCHES}
