"""L1/013 fused residual RMSNorm backward, one pass over the rows.

    gn = fp32(grad_output) * weight
    dx = rstd * (gn - x * rstd^2 * sum_j(gn_j x_j) / H)
    grad_hidden_states = grad_residual = bf16(dx)
    grad_weight = sum over rows of fp32(grad_output) * normalized   (normalized = x * rstd if not given)

Work split: a persistent grid of CTAs strides over the rows; a CTA owns one row at a time,
each thread a fixed set of 4-wide column vectors (16-byte fp32 / 8-byte bf16 accesses),
so the row's values stay in registers between the dot product and the gradient (one read of
each input). The dot product is a warp shuffle plus a shared-memory exchange between warps,
double-buffered by row parity so one barrier per row suffices. Because a thread's columns
never change, it accumulates grad_weight for them in registers across all its CTA's rows;
each CTA writes one fp32 partial row, and `ColumnSum` adds the partials in a fixed order:
no float atomics, so grad_weight is bitwise repeatable.
"""
from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import BFloat16, Float32, Int32

VECTOR = 4  # elements per access
MAX_THREADS = 1024
TARGET_VECTORS_PER_THREAD = 5  # H = 2560 -> 128 threads x 5 vectors, no predication


def _vector(row_tensor, index):
    """Column vector `index` (VECTOR wide) of a row."""
    return cute.zipped_divide(row_tensor, (VECTOR,))[None, index]


def _row_view(ptr, seq, batch, stride_s, stride_b, hidden):
    """A [(seq, batch), hidden] view: a linear row index r = s + seq * b walks the (s, b) pair."""
    return cute.make_tensor(ptr, cute.make_layout(((seq, batch), hidden), stride=((stride_s, stride_b), 1)))


class FusedResidualRmsNormBackward:
    def __init__(self, hidden: int, read_normalized: bool):
        if hidden % VECTOR:
            raise ValueError(f"hidden size {hidden} must be a multiple of {VECTOR}")
        self.hidden = hidden
        self.read_normalized = read_normalized
        vectors = hidden // VECTOR
        self.threads = min(MAX_THREADS, max(32, 32 * -(-vectors // (32 * TARGET_VECTORS_PER_THREAD))))
        self.vectors_per_thread = -(-vectors // self.threads)
        self.warps = self.threads // 32

    @cute.jit
    def __call__(self, grad_output: cute.Pointer, x: cute.Pointer, normalized: cute.Pointer,
                 rstd: cute.Pointer, weight: cute.Pointer, grad_hidden: cute.Pointer,
                 grad_residual: cute.Pointer, partials: cute.Pointer, seq: Int32, batch: Int32,
                 go_stride_s: Int32, go_stride_b: Int32, ctas: Int32, stream: cuda.CUstream):
        h = self.hidden
        rows = seq * batch
        # grad_output strides arrive in units of VECTOR elements so the compiler knows every
        # row start is vector aligned.
        m_go = _row_view(grad_output, seq, batch, cute.assume(go_stride_s * VECTOR, divby=VECTOR),
                         cute.assume(go_stride_b * VECTOR, divby=VECTOR), h)
        m_x = cute.make_tensor(x, cute.make_layout((rows, h), stride=(h, 1)))
        m_norm = cute.make_tensor(normalized, cute.make_layout((rows, h), stride=(h, 1)))
        m_rstd = cute.make_tensor(rstd, cute.make_layout((rows,)))
        m_w = cute.make_tensor(weight, cute.make_layout((h,)))
        m_gh = cute.make_tensor(grad_hidden, cute.make_layout((rows, h), stride=(h, 1)))
        m_gr = cute.make_tensor(grad_residual, cute.make_layout((rows, h), stride=(h, 1)))
        m_part = cute.make_tensor(partials, cute.make_layout((ctas, h), stride=(h, 1)))
        self.kernel(m_go, m_x, m_norm, m_rstd, m_w, m_gh, m_gr, m_part).launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, m_go: cute.Tensor, m_x: cute.Tensor, m_norm: cute.Tensor, m_rstd: cute.Tensor,
               m_w: cute.Tensor, m_gh: cute.Tensor, m_gr: cute.Tensor, m_part: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        lane, warp = tidx % 32, tidx // 32
        h, vpt, vectors = self.hidden, self.vectors_per_thread, self.hidden // VECTOR
        rows = m_x.shape[0]

        smem = cutlass.memory.SmemAllocator()
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2)), byte_alignment=16)

        wide = lambda t: cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), t.element_type,
                                             num_bits_per_copy=VECTOR * t.element_type.width)
        load_bf16, load_f32, store_bf16, store_f32 = wide(m_go), wide(m_x), wide(m_gh), wide(m_part)

        threads = self.threads
        weight = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        grad_weight = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        g = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        xs = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        staging_bf16 = cute.make_rmem_tensor((VECTOR,), BFloat16)
        staging_f32 = cute.make_rmem_tensor((VECTOR,), Float32)
        grad_weight.fill(0.0)
        weight.fill(0.0)
        g.fill(0.0)
        xs.fill(0.0)
        for k in cutlass.range_constexpr(vpt):
            if tidx + k * threads < vectors:  # uneven rows leave the last vectors idle
                cute.copy(load_f32, _vector(m_w, tidx + k * threads), staging_f32)
                weight[None, k].store(staging_f32.load())

        for it in cutlass.range(0, cute.ceil_div(rows - bidx, ctas)):
            row = bidx + it * ctas
            rstd = m_rstd[row]
            dot = Float32(0.0)
            for k in cutlass.range_constexpr(vpt):
                if tidx + k * threads < vectors:  # uneven rows leave the last vectors idle
                    cute.copy(load_bf16, _vector(m_go[row, None], tidx + k * threads), staging_bf16)
                    g[None, k].store(staging_bf16.load().to(Float32))
                    cute.copy(load_f32, _vector(m_x[row, None], tidx + k * threads), staging_f32)
                    xs[None, k].store(staging_f32.load())
                    if cutlass.const_expr(self.read_normalized):
                        cute.copy(load_f32, _vector(m_norm[row, None], tidx + k * threads), staging_f32)
                        normalized = staging_f32.load()
                    else:
                        normalized = xs[None, k].load() * rstd
                    gk = g[None, k].load()
                    grad_weight[None, k].store(grad_weight[None, k].load() + gk * normalized)
                    dot += (gk * weight[None, k].load() * xs[None, k].load()).reduce(
                        cute.ReductionOp.ADD, Float32(0.0), 0)
            dot = cute.arch.warp_reduction(dot, lambda a, b: a + b)
            parity = it % 2
            if lane == 0:
                warp_sums[warp, parity] = dot
            cute.arch.barrier()
            # Every thread sums the warps in the same order: the row's dot is identical everywhere.
            total = Float32(0.0)
            for w in cutlass.range_constexpr(self.warps):
                total += warp_sums[w, parity]
            scale = rstd * rstd * total * (1.0 / h)
            for k in cutlass.range_constexpr(vpt):
                if tidx + k * threads < vectors:  # uneven rows leave the last vectors idle
                    gk, xk = g[None, k].load(), xs[None, k].load()
                    dx = (rstd * (gk * weight[None, k].load() - xk * scale)).to(BFloat16)
                    staging_bf16.store(dx)
                    cute.copy(store_bf16, staging_bf16, _vector(m_gh[row, None], tidx + k * threads))
                    cute.copy(store_bf16, staging_bf16, _vector(m_gr[row, None], tidx + k * threads))

        for k in cutlass.range_constexpr(vpt):
            if tidx + k * threads < vectors:  # uneven rows leave the last vectors idle
                staging_f32.store(grad_weight[None, k].load())
                cute.copy(store_f32, staging_f32, _vector(m_part[bidx, None], tidx + k * threads))


class ColumnSum:
    """out[j] = sum_i partials[i, j], rows added in index order (a fixed order: repeatable)."""

    THREADS = 128

    def __init__(self, hidden: int):
        self.hidden = hidden

    @cute.jit
    def __call__(self, partials: cute.Pointer, out: cute.Pointer, count: Int32, stream: cuda.CUstream):
        m_part = cute.make_tensor(partials, cute.make_layout((count, self.hidden), stride=(self.hidden, 1)))
        m_out = cute.make_tensor(out, cute.make_layout((self.hidden,)))
        self.kernel(m_part, m_out).launch(
            grid=[cute.ceil_div(self.hidden // VECTOR, self.THREADS), 1, 1], block=[self.THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, m_part: cute.Tensor, m_out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        v = bidx * self.THREADS + tidx
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=VECTOR * 32)
        if v < self.hidden // VECTOR:
            acc = cute.make_rmem_tensor((VECTOR,), Float32)
            staging = cute.make_rmem_tensor((VECTOR,), Float32)
            acc.fill(0.0)
            for i in cutlass.range(0, m_part.shape[0]):
                cute.copy(atom, cute.zipped_divide(m_part[i, None], (VECTOR,))[None, v], staging)
                acc.store(acc.load() + staging.load())
            cute.copy(atom, acc, cute.zipped_divide(m_out, (VECTOR,))[None, v])


CTAS_PER_SM = 4  # 128 threads x ~100 registers: four CTAs (four rows in flight) per SM
MAX_HIDDEN = 16384


def _builds(hidden: int, read_normalized: bool, arch: str, dump_dir=None):
    """The two compiled kernels for one hidden size; row counts and strides are runtime values."""
    from . import runtime

    f, stream, one = runtime.fake_ptr, runtime.fake_stream(), Int32(1)
    backward = runtime.compile_kernel(
        ("fused_residual_rmsnorm_backward", hidden, read_normalized),
        FusedResidualRmsNormBackward(hidden, read_normalized),
        f(BFloat16, 8), f(Float32), f(Float32), f(Float32, 4), f(Float32), f(BFloat16, 8),
        f(BFloat16, 8), f(Float32), one, one, one, one, one, stream, arch=arch, dump_dir=dump_dir)
    column_sum = runtime.compile_kernel(("column_sum", hidden), ColumnSum(hidden), f(Float32), f(Float32),
                                        one, stream, arch=arch, dump_dir=dump_dir)
    return backward, column_sum


def _check_inputs(grad_output, x, normalized, rstd, weight):
    import torch

    from .checks import check_same_device, check_tensor

    check_tensor("grad_output", grad_output, dtypes=torch.bfloat16, ndim=3, contiguous=False, align=8)
    batch, seq, hidden = grad_output.shape
    if hidden % 8 or not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"grad_output: hidden size must be a positive multiple of 8 up to {MAX_HIDDEN}, got {hidden}")
    if grad_output.stride(2) != 1 or grad_output.stride(0) % VECTOR or grad_output.stride(1) % VECTOR:
        raise ValueError(f"grad_output: needs a contiguous last dimension and batch/seq strides that are "
                         f"multiples of {VECTOR}, got strides {grad_output.stride()}")
    check_tensor("x", x, dtypes=torch.float32, shape=(batch, seq, hidden))
    if normalized is not None:
        check_tensor("normalized", normalized, dtypes=torch.float32, shape=(batch, seq, hidden))
    check_tensor("rstd", rstd, dtypes=torch.float32, shape=(batch, seq, 1), align=4)
    check_tensor("weight", weight, dtypes=torch.float32, shape=(hidden,))
    check_same_device(grad_output=grad_output, x=x, normalized=normalized, rstd=rstd, weight=weight)
    go_extent = sum((n - 1) * s for n, s in zip(grad_output.shape, grad_output.stride())) + 1
    if max(x.numel(), go_extent) >= 2**31:
        raise ValueError("inputs of 2^31 or more elements are not supported (32-bit offsets)")
    return batch, seq, hidden


def _check_out(out, x):
    import torch

    from .checks import check_same_device, check_tensor

    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError("out: expected (grad_hidden_states, grad_residual, grad_weight)")
    batch, seq, hidden = x.shape
    for name, t in zip(("grad_hidden_states", "grad_residual"), out[:2]):
        check_tensor(f"out[{name}]", t, dtypes=torch.bfloat16, shape=(batch, seq, hidden), align=8)
    check_tensor("out[grad_weight]", out[2], dtypes=torch.float32, shape=(hidden,))
    check_same_device(x=x, grad_hidden_states=out[0], grad_residual=out[1], grad_weight=out[2])
    return tuple(out)


def fused_residual_rmsnorm_backward(grad_output, x, normalized, rstd, weight, *, out=None):
    """L1/013: -> (grad_hidden_states, grad_residual, grad_weight), as semantics.md says.

    grad_output bf16 [b, s, H] (any batch/seq strides, contiguous last dim); x, normalized fp32
    [b, s, H] contiguous; rstd fp32 [b, s, 1]; weight fp32 [H]; H a multiple of 8 up to 16384.
    normalized=None: the caller guarantees normalized == x * rstd, and the kernel computes it
    instead of reading it (10 bytes per element instead of 14). out=(grad_hidden_states,
    grad_residual, grad_weight) writes into the caller's tensors. grad_weight is bitwise
    repeatable: per-CTA partial sums added in a fixed order, no atomics.
    """
    import torch

    from . import runtime

    batch, seq, hidden = _check_inputs(grad_output, x, normalized, rstd, weight)
    device = x.device
    if out is None:
        out = (torch.empty_like(x, dtype=torch.bfloat16), torch.empty_like(x, dtype=torch.bfloat16),
               torch.empty(hidden, dtype=torch.float32, device=device))
    else:
        out = _check_out(out, x)
    grad_hidden, grad_residual, grad_weight = out
    rows = batch * seq
    if rows == 0:
        grad_weight.zero_()
        return out
    ctas = min(rows, CTAS_PER_SM * _sm_count(device.index))
    partials = torch.empty(ctas, hidden, dtype=torch.float32, device=device)
    backward, column_sum = _builds(hidden, normalized is not None, runtime.device_arch(device.index))
    stream = runtime.current_stream(device)
    p = runtime.gmem_ptr
    backward(p(grad_output, BFloat16, 8), p(x, Float32), p(x if normalized is None else normalized, Float32),
             p(rstd, Float32, 4), p(weight, Float32), p(grad_hidden, BFloat16, 8), p(grad_residual, BFloat16, 8),
             p(partials, Float32), Int32(seq), Int32(batch), Int32(grad_output.stride(1) // VECTOR),
             Int32(grad_output.stride(0) // VECTOR), Int32(ctas), stream)
    column_sum(p(partials, Float32), p(grad_weight, Float32), Int32(ctas), stream)
    return out


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


AUDIT_BUILDS = {
    f"fused_residual_rmsnorm_backward[H={h},{'normalized' if rn else 'normalized=None'}]":
        (lambda arch, dump_dir, h=h, rn=rn: _builds(h, rn, arch, dump_dir)[0])
    for h, rn in ((2560, True), (2560, False), (1000, True))
}
AUDIT_BUILDS["column_sum[H=2560]"] = lambda arch, dump_dir: _builds(2560, True, arch, dump_dir)[1]
# 128-bit loads of x/normalized/weight and stores of the partials; no local-memory spills.
AUDIT_EXPECTS = {arch: {"require": ["LDG.128"], "forbid": ["LOCAL", "ATOM/RED"]} for arch in ("sm_90a", "sm_100a")}
