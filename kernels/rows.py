"""Row-at-a-time building blocks shared by the RMSNorm-backward kernels (the fused residual
RMSNorm backward, the embedding backward).

A CTA owns one row at a time; thread `tidx` owns column vectors tidx, tidx + threads, ...
(VECTOR elements each: 16-byte fp32 / 8-byte bf16 accesses), held in registers as fp32
[VECTOR, vectors_per_thread] tensors. Vectors past the row's end stay zero, so sums over a
thread's registers need no predicate.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import AddressSpace, BFloat16, Float32, Int32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import T, dsl_user_op

VECTOR = 4  # elements per access
MAX_THREADS = 1024
MAX_HIDDEN = 16384  # the largest row the norm-backward ops accept (4 vectors per thread at 1024 threads)


def thread_split(hidden: int, target_vectors_per_thread: int):
    """(threads, vectors per thread, warps) for a row of `hidden` elements: whole warps, about
    `target_vectors_per_thread` vectors each, at most MAX_THREADS."""
    vectors = hidden // VECTOR
    threads = min(MAX_THREADS, max(32, 32 * -(-vectors // (32 * target_vectors_per_thread))))
    return threads, -(-vectors // threads), threads // 32


def fake_rows(dtype, batch, seq, hidden: int):
    """Compile-time stand-in for a [batch, seq, hidden] tensor: free batch/seq strides that are
    multiples of VECTOR (every row start vector aligned), contiguous rows, VECTOR-aligned base."""
    from . import runtime

    strides = (cute.sym_int64(divisibility=VECTOR), cute.sym_int64(divisibility=VECTOR), 1)
    return runtime.fake_tensor(dtype, (batch, seq, hidden), strides, VECTOR * dtype.width // 8)


def fake_rstd(batch, seq):
    """Compile-time stand-in for an fp32 [batch, seq, 1] rstd with any strides."""
    from . import runtime

    return runtime.fake_tensor(Float32, (batch, seq, 1), (cute.sym_int64(), cute.sym_int64(), cute.sym_int64()), 4)


def vector(row_tensor, index):
    """Column vector `index` (VECTOR wide) of a row."""
    return cute.zipped_divide(row_tensor, (VECTOR,))[None, index]


def rows_view(t):
    """A [batch, seq, ...] tensor seen as [(seq, batch), ...]: one linear row index r = s + seq * b
    walks both modes through the tensor's own strides (any batch/seq strides work)."""
    shape, stride = t.shape, t.stride
    return cute.make_tensor(t.iterator, cute.make_layout(((shape[1], shape[0]), *shape[2:]),
                                                         stride=((stride[1], stride[0]), *stride[2:])))


def wide_copy(element_type):
    """A copy atom moving one VECTOR of `element_type` per instruction."""
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), element_type,
                               num_bits_per_copy=VECTOR * element_type.width)


@cute.jit
def read_row(loads, rows, values, tidx, threads: cutlass.Constexpr, vpt: cutlass.Constexpr,
             vectors: cutlass.Constexpr):
    """This thread's vectors of each row in `rows` (bf16 or fp32) into fp32 `values`;
    `loads` = (bf16 atom, fp32 atom)."""
    staging = (cute.make_rmem_tensor((VECTOR,), BFloat16), cute.make_rmem_tensor((VECTOR,), Float32))
    for k in cutlass.range_constexpr(vpt):
        if tidx + k * threads < vectors:
            for src, dst in zip(rows, values):
                which = 0 if cutlass.const_expr(src.element_type == BFloat16) else 1
                cute.copy(loads[which], vector(src, tidx + k * threads), staging[which])
                dst[None, k].store(staging[which].load().to(Float32))


@cute.jit
def store_row(atom, values, row, tidx, threads: cutlass.Constexpr, vpt: cutlass.Constexpr,
              vectors: cutlass.Constexpr):
    """This thread's fp32 `values` into `row`, converted to the row's element type."""
    staging = cute.make_rmem_tensor((VECTOR,), row.element_type)
    for k in cutlass.range_constexpr(vpt):
        if tidx + k * threads < vectors:
            staging.store(values[None, k].load().to(row.element_type))
            cute.copy(atom, staging, vector(row, tidx + k * threads))


@cute.jit
def row_sum(partial, warp_sums, parity, lane, warp, warps: cutlass.Constexpr):
    """The CTA-wide sum of each thread's `partial` for the current row.

    A warp shuffle, then one shared-memory exchange between warps: `warp_sums` is [warps, 2]
    and `parity` alternates by row, so one barrier per row suffices. Every thread adds the
    warps in the same order, so the row's value is identical in every thread.
    """
    partial = cute.arch.warp_reduction(partial, lambda a, b: a + b)
    if lane == 0:
        warp_sums[warp, parity] = partial
    cute.arch.barrier()
    total = Float32(0.0)
    for w in cutlass.range_constexpr(warps):
        total += warp_sums[w, parity]
    return total


def ring_stages(row_bytes: int, budget_bytes: int, max_stages: int = 4) -> int:
    """How many rows a cp.async ring holds within `budget_bytes`; below 2 there is no ring."""
    stages = min(max_stages, budget_bytes // row_bytes)
    return stages if stages >= 2 else 0


def alloc_ring(smem, sources, hidden: int, stages: int):
    """Shared-memory ring slots, [hidden, stages] per source tensor, in its element type."""
    return tuple(smem.allocate_tensor(t.element_type, cute.make_layout((hidden, stages)), byte_alignment=16)
                 for t in sources)


def cp_async_atoms():
    """(bf16 8-byte, fp32 16-byte L2-only, fp32 4-byte) cp.async atoms: global to shared, no
    registers."""
    cpasync = cute.nvgpu.cpasync
    return (cute.make_copy_atom(cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=64),
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32,
                                num_bits_per_copy=128),
            cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32))


def element(tensor, index):
    """Element `index` of a 1-D tensor (any layout) as a one-element tensor, for a copy."""
    return cute.make_tensor(tensor.iterator + cute.crd2idx(index, tensor.layout), cute.make_layout((1,)))


@cute.jit
def fetch_row(fetches, rows, ring, stage, tidx, threads: cutlass.Constexpr, vpt: cutlass.Constexpr,
              vectors: cutlass.Constexpr):
    """cp.async this thread's vectors of each row in `rows` into ring slot `stage`. The thread
    later reads back only these vectors, so the ring needs no barrier, only the thread's own
    cp.async groups (commit one per row, wait until the row's group has landed)."""
    for k in cutlass.range_constexpr(vpt):
        if tidx + k * threads < vectors:
            for src, dst in zip(rows, ring):
                atom = fetches[0] if cutlass.const_expr(src.element_type == BFloat16) else fetches[1]
                cute.copy(atom, vector(src, tidx + k * threads), vector(dst[None, stage], tidx + k * threads))


@dsl_user_op
def load_remote_vector(smem_ptr, rank, *, loc=None, ip=None):
    """The VECTOR fp32 values at `smem_ptr` (16-byte aligned) in the shared memory of cluster
    CTA `rank`: one ld.shared::cluster.v4 (the DSL's tensors cannot load from distributed
    shared memory). Marked as having side effects so it stays after the cluster barrier."""
    remote = nvvm.mapa(llvm.PointerType.get(AddressSpace.dsmem), smem_ptr.to_llvm_ptr(loc=loc, ip=ip),
                       Int32(rank).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    address = llvm.ptrtoint(T.i32(), remote, loc=loc, ip=ip)
    values = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * VECTOR), [address],
                             "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
                             has_side_effects=True, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), values, [e], loc=loc, ip=ip)) for e in range(VECTOR)]


@dsl_user_op
def thread_index_again(*, loc=None, ip=None):
    """threadIdx.x read anew (a side-effecting read the compiler cannot merge with an earlier
    one): addresses computed from it after a long loop are not kept live across the loop."""
    value = llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r", has_side_effects=True, loc=loc, ip=ip)
    return Int32(value)
