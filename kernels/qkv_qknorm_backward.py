"""L1/051 Gemma3 QKV projection with Q/K RMSNorm backward, first version: the norm backward in
one kernel, then the products on the GEMM core (issue 7's summed and grouped modes).

    dq = bf16(rms_dx(grad_query * (1 + q_norm_weight), query_transposed, q_rstd))   per head row
    grad_q_norm_weight = sum over rows of fp32(grad_query) * q_normed                (k likewise)
    grad_hidden_states = [dq dk dv] . [Wq; Wk; Wv]          one summed product (matmul_nt_summed)
    grad_{q,k,v}_weight = [dq dk dv]^T . hidden_states      one grouped product (matmul_nt_grouped)

Launches: the norm kernel and two fixed-order column sums (one FFI call), the summed product,
the grouped product. dq and dk go through global memory as bf16 [T, heads * d] (the
projections' row layout, written there directly): issue 9's aim, dq and dk made inside the
products' operand path and never written, is the next step; this version is the correct
baseline it is measured against.

Norm kernel work split: one warp per (token, head) row; a lane holds 16-byte vectors of 8
bf16 (d = 256: one per lane), so the row's dot product is one warp reduction. Warps walk the
q rows then the k rows, grid-stride, a fixed set of rows per warp for a given row count; each
keeps fp32 sums of grad * normed for its lanes' columns, and the CTA adds its warps in warp
order into one partial row per CTA (q and k apart). `ColumnSum` adds the partial rows in a
fixed order: bitwise repeatable norm-weight gradients, no float atomics.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import BFloat16, Float32, Int32

from . import runtime
from .column_sum import ColumnSum

VECTOR = 8  # bf16 elements per 16-byte access
WARPS = 8
CTAS_PER_SM = 4
MAX_HEAD_DIM = 1024


def head_rows(t):
    """[b, heads, s, d] -> [(s, heads, b), d]: row r = s + seq * (head + heads * b) walks the
    per-head rows through the tensor's own strides."""
    shape, stride = t.shape, t.stride
    return cute.make_tensor(t.iterator, cute.make_layout(((shape[2], shape[1], shape[0]), shape[3]),
                                                         stride=((stride[2], stride[1], stride[0]), stride[3])))


def token_rows(t):
    """[b, s, heads, d] (a view of the projection's [T, heads * d]) -> [(s, heads, b), d], row
    for row the same order as head_rows."""
    shape, stride = t.shape, t.stride
    return cute.make_tensor(t.iterator, cute.make_layout(((shape[1], shape[2], shape[0]), shape[3]),
                                                         stride=((stride[1], stride[2], stride[0]), stride[3])))


class QkNormBackward:
    """dq, dk and the per-CTA partials of both norm-weight gradients, then their column sums."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.vectors = head_dim // VECTOR
        self.vectors_per_lane = -(-self.vectors // 32)
        self.column_sum = ColumnSum(head_dim)

    @cute.jit
    def __call__(self, grad_q: cute.Tensor, pre_q: cute.Tensor, rstd_q: cute.Tensor, normed_q: cute.Tensor,
                 weight_q: cute.Tensor, dq: cute.Tensor, grad_k: cute.Tensor, pre_k: cute.Tensor,
                 rstd_k: cute.Tensor, normed_k: cute.Tensor, weight_k: cute.Tensor, dk: cute.Tensor,
                 partials_q: cute.Tensor, partials_k: cute.Tensor, grad_weight_q: cute.Tensor,
                 grad_weight_k: cute.Tensor, ctas: Int32, stream: cuda.CUstream):
        q = (head_rows(grad_q), head_rows(pre_q), head_rows(rstd_q), head_rows(normed_q), weight_q, token_rows(dq))
        k = (head_rows(grad_k), head_rows(pre_k), head_rows(rstd_k), head_rows(normed_k), weight_k, token_rows(dk))
        self.kernel(*q, *k, partials_q, partials_k).launch(grid=[ctas, 1, 1], block=[32 * WARPS, 1, 1],
                                                           stream=stream)
        # grad_weight_q, grad_weight_k = the partial rows of the CTAs that ran, added in order
        self.column_sum(partials_q, grad_weight_q, stream)
        self.column_sum(partials_k, grad_weight_k, stream)

    @cute.kernel
    def kernel(self, g_q: cute.Tensor, x_q: cute.Tensor, r_q: cute.Tensor, n_q: cute.Tensor, w_q: cute.Tensor,
               o_q: cute.Tensor, g_k: cute.Tensor, x_k: cute.Tensor, r_k: cute.Tensor, n_k: cute.Tensor,
               w_k: cute.Tensor, o_k: cute.Tensor, m_part_q: cute.Tensor, m_part_k: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        lane, warp = tidx % 32, tidx // 32
        vpl = self.vectors_per_lane
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=16 * 8)
        scale_q = self.one_plus(atom, w_q, lane)
        scale_k = self.one_plus(atom, w_k, lane)
        sums_q = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        sums_k = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        sums_q.fill(0.0)
        sums_k.fill(0.0)
        rows_q, rows_k = cute.size(g_q, mode=[0]), cute.size(g_k, mode=[0])
        for r in cutlass.range(bidx * WARPS + warp, rows_q + rows_k, ctas * WARPS):
            if r < rows_q:
                self.row(atom, g_q, x_q, r_q, n_q, o_q, scale_q, sums_q, r, lane)
            else:
                self.row(atom, g_k, x_k, r_k, n_k, o_k, scale_k, sums_k, r - rows_q, lane)
        smem = cutlass.memory.SmemAllocator()
        across = smem.allocate_tensor(Float32, cute.make_layout((self.head_dim, WARPS)), byte_alignment=16)
        self.partial_row(sums_q, across, m_part_q[bidx, None], lane, warp, tidx)
        self.partial_row(sums_k, across, m_part_k[bidx, None], lane, warp, tidx)

    @cute.jit
    def one_plus(self, atom, m_weight, lane):
        """(1 + norm weight) in fp32 for this lane's columns."""
        scale = cute.make_rmem_tensor((VECTOR, self.vectors_per_lane), Float32)
        staging = cute.make_rmem_tensor((VECTOR,), BFloat16)
        scale.fill(0.0)
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            if lane + 32 * j < self.vectors:
                cute.copy(atom, cute.zipped_divide(m_weight, (VECTOR,))[None, lane + 32 * j], staging)
                scale[None, j].store(staging.load().to(Float32) + 1.0)
        return scale

    @cute.jit
    def row(self, atom, m_grad, m_pre, m_rstd, m_normed, m_out, scale, sums, r, lane):
        """One head row: out = bf16(rstd * gn - x * rstd^3 * sum(gn * x) / d) with gn = grad * scale;
        sums += grad * normed."""
        vpl = self.vectors_per_lane
        grad = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        pre = cute.make_rmem_tensor((VECTOR, vpl), Float32)
        staging = cute.make_rmem_tensor((VECTOR,), BFloat16)
        grad.fill(0.0)
        pre.fill(0.0)
        rstd = m_rstd[r, 0]
        dot = Float32(0.0)
        for j in cutlass.range_constexpr(vpl):
            v = lane + 32 * j
            if v < self.vectors:
                cute.copy(atom, cute.zipped_divide(m_grad[r, None], (VECTOR,))[None, v], staging)
                grad[None, j].store(staging.load().to(Float32))
                cute.copy(atom, cute.zipped_divide(m_pre[r, None], (VECTOR,))[None, v], staging)
                pre[None, j].store(staging.load().to(Float32))
                cute.copy(atom, cute.zipped_divide(m_normed[r, None], (VECTOR,))[None, v], staging)
                sums[None, j].store(sums[None, j].load() + grad[None, j].load() * staging.load().to(Float32))
                gn = grad[None, j].load() * scale[None, j].load()
                dot += (gn * pre[None, j].load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        dot = cute.arch.warp_reduction(dot, lambda a, b: a + b)
        coefficient = rstd * rstd * rstd * dot * (1.0 / self.head_dim)
        for j in cutlass.range_constexpr(vpl):
            v = lane + 32 * j
            if v < self.vectors:
                gn = grad[None, j].load() * scale[None, j].load()
                staging.store((gn * rstd - pre[None, j].load() * coefficient).to(BFloat16))
                cute.copy(atom, staging, cute.zipped_divide(m_out[r, None], (VECTOR,))[None, v])

    @cute.jit
    def partial_row(self, sums, across, m_partial_row, lane, warp, tidx):
        """The CTA's partial row: its warps' sums added in warp order."""
        for j in cutlass.range_constexpr(self.vectors_per_lane):
            v = lane + 32 * j
            if v < self.vectors:
                for e in cutlass.range_constexpr(VECTOR):
                    across[v * VECTOR + e, warp] = sums[e, j]
        cute.arch.barrier()
        for c in cutlass.range(tidx, self.head_dim, 32 * WARPS):
            total = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                total += across[c, w]
            m_partial_row[c] = total
        cute.arch.barrier()  # `across` is reused for the next partial row


def _fake_args(head_dim: int):
    """Compile-time stand-ins. One batch, seq and heads symbol per side (q, k) shared by its
    tensors, so the call checks their extents agree in C: per-head tensors [b, heads, s, d] and
    the row outputs [b, s, heads, d] with free strides (multiples of 8, unit last stride), rstd
    [b, heads, s, 1] any strides, the partials any row count; d static."""
    batch, seq = cute.sym_int32(), cute.sym_int32()

    def strided(dtype, shape):
        strides = (*(cute.sym_int64(divisibility=VECTOR) for _ in range(3)), 1)
        return runtime.fake_tensor(dtype, shape, strides, 16)

    def side(heads):
        per_head = (batch, heads, seq, head_dim)
        rstd = runtime.fake_tensor(Float32, (batch, heads, seq, 1), tuple(cute.sym_int64() for _ in range(4)), 4)
        weight = runtime.fake_tensor(BFloat16, (head_dim,), (1,), 16)
        return (strided(BFloat16, per_head), strided(BFloat16, per_head), rstd, strided(BFloat16, per_head), weight,
                strided(BFloat16, (batch, seq, heads, head_dim)))

    def partials():
        return runtime.fake_tensor(Float32, (cute.sym_int32(), head_dim), (cute.sym_int64(divisibility=4), 1), 16)

    def grad_weight():
        return runtime.fake_tensor(Float32, (head_dim,), (1,), 16)

    return (*side(cute.sym_int32()), *side(cute.sym_int32()), partials(), partials(), grad_weight(), grad_weight(),
            Int32(1))


def _build(head_dim: int, arch: str, dump_dir=None):
    return runtime.compile_kernel(("qk_norm_backward", head_dim), QkNormBackward(head_dim), *_fake_args(head_dim),
                                  runtime.env_stream(), arch=arch, dump_dir=dump_dir, tvm_ffi=True)


AUDIT_BUILDS = {"qkv_qknorm_backward norm rows[d=256]": lambda arch, dump_dir: _build(256, arch, dump_dir)}
# 16-byte loads and stores of the bf16 rows, 16-byte loads of the partials (the column sums);
# no spills, no atomics (fixed-order sums).
AUDIT_EXPECTS = {arch: {"require": ["LDG.128", "STG.128"], "forbid": ["LOCAL", "ATOM/RED"]}
                 for arch in runtime.ARCHES}


class _Entry:
    """What one (head size, device) needs per call, resolved once."""

    def __init__(self, head_dim: int, device):
        import torch

        self.device = device
        self.max_ctas = CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        self.run = runtime.ffi_function(_build(head_dim, runtime.device_arch(device.index)))
        # per CTA: its partial rows of both norm-weight gradients, q then k
        self.partials = runtime.StreamWorkspace(self.max_ctas, 2 * head_dim, device)


_entries: dict = {}

OUTPUT_NAMES = ("grad_hidden_states", "grad_q_weight", "grad_k_weight", "grad_v_weight", "grad_q_norm_weight",
                "grad_k_norm_weight")


def _check_inputs(grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight, q_norm_weight,
                  k_norm_weight, query_transposed, key_transposed, q_rstd, k_rstd, q_normed, k_normed):
    """Shapes, dtypes, devices and the layouts read in place, named in the messages."""
    import torch

    from .checks import check_same_device, check_tensor

    check_tensor("hidden_states", hidden_states, dtypes=torch.bfloat16, ndim=3)
    batch, seq, hidden = hidden_states.shape
    check_tensor("grad_query", grad_query, dtypes=torch.bfloat16, ndim=4, contiguous=False)
    _, q_heads, _, head_dim = grad_query.shape
    check_tensor("grad_key", grad_key, dtypes=torch.bfloat16, ndim=4, contiguous=False)
    kv_heads = grad_key.shape[1]
    if head_dim % VECTOR or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"grad_query: head_dim must be a positive multiple of {VECTOR} up to {MAX_HEAD_DIM}, "
                         f"got {head_dim}")
    q_rows, kv_rows = (batch, q_heads, seq, head_dim), (batch, kv_heads, seq, head_dim)
    for name, t, shape in (("grad_query", grad_query, q_rows), ("query_transposed", query_transposed, q_rows),
                           ("q_normed", q_normed, q_rows), ("grad_key", grad_key, kv_rows),
                           ("key_transposed", key_transposed, kv_rows), ("k_normed", k_normed, kv_rows)):
        check_tensor(name, t, dtypes=torch.bfloat16, shape=shape, contiguous=False)
        if t.stride(3) != 1 or any(t.stride(i) % VECTOR for i in range(3)):
            raise ValueError(f"{name}: needs a contiguous last dimension and other strides that are multiples of "
                             f"{VECTOR}, got strides {t.stride()}")
    check_tensor("grad_value", grad_value, dtypes=torch.bfloat16, shape=kv_rows, contiguous=False)
    if kv_heads != 1 or grad_value.stride(3) != 1 or grad_value.stride(2) != head_dim \
            or (batch > 1 and grad_value.stride(0) != seq * head_dim):
        raise ValueError(f"grad_value: read in place as the [tokens, {head_dim}] operand, so one kv head with "
                         f"contiguous rows (strides [s * d, *, d, 1]); got shape {list(grad_value.shape)}, "
                         f"strides {grad_value.stride()}")
    check_tensor("q_rstd", q_rstd, dtypes=torch.float32, shape=(batch, q_heads, seq, 1), contiguous=False, align=4)
    check_tensor("k_rstd", k_rstd, dtypes=torch.float32, shape=(batch, kv_heads, seq, 1), contiguous=False,
                 align=4)
    check_tensor("q_weight", q_weight, dtypes=torch.bfloat16, shape=(q_heads * head_dim, hidden))
    check_tensor("k_weight", k_weight, dtypes=torch.bfloat16, shape=(kv_heads * head_dim, hidden))
    check_tensor("v_weight", v_weight, dtypes=torch.bfloat16, shape=(kv_heads * head_dim, hidden))
    check_tensor("q_norm_weight", q_norm_weight, dtypes=torch.bfloat16, shape=(head_dim,))
    check_tensor("k_norm_weight", k_norm_weight, dtypes=torch.bfloat16, shape=(head_dim,))
    check_same_device(grad_query=grad_query, grad_key=grad_key, grad_value=grad_value, hidden_states=hidden_states,
                      q_weight=q_weight, k_weight=k_weight, v_weight=v_weight, q_norm_weight=q_norm_weight,
                      k_norm_weight=k_norm_weight, query_transposed=query_transposed, key_transposed=key_transposed,
                      q_rstd=q_rstd, k_rstd=k_rstd, q_normed=q_normed, k_normed=k_normed)


def _outputs(out, hidden_states, q_weight, k_weight, v_weight, head_dim):
    """The caller's six outputs checked, or new ones."""
    import torch

    from .checks import check_same_device, check_tensor

    shapes = (tuple(hidden_states.shape), tuple(q_weight.shape), tuple(k_weight.shape), tuple(v_weight.shape),
              (head_dim,), (head_dim,))
    dtypes = (torch.bfloat16,) * 4 + (torch.float32,) * 2
    if out is None:
        return tuple(torch.empty(s, dtype=d, device=hidden_states.device) for s, d in zip(shapes, dtypes))
    if not isinstance(out, (tuple, list)) or len(out) != 6:
        raise ValueError(f"out: a tuple of the six outputs {OUTPUT_NAMES}")
    for name, t, shape, dtype in zip(OUTPUT_NAMES, out, shapes, dtypes):
        check_tensor(f"out[{name}]", t, dtypes=dtype, shape=shape)
    check_same_device(hidden_states=hidden_states, **dict(zip(OUTPUT_NAMES, out)))
    return tuple(out)


def qkv_qknorm_backward(grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight,
                        q_norm_weight, k_norm_weight, query_transposed, key_transposed, q_rstd, k_rstd, q_normed,
                        k_normed, rms_norm_eps=1e-6, *, out=None):
    """L1/051 -> (grad_hidden_states, grad_q_weight, grad_k_weight, grad_v_weight,
    grad_q_norm_weight, grad_k_norm_weight), as semantics.md says (rms_norm_eps is already
    inside the given rstd). Per-head tensors [b, heads, s, d] are read in place through their
    strides (unit last stride, others multiples of 8); grad_value is read in place as the
    [T, d] operand, so one kv head (Gemma-3-270m's) with contiguous rows. out= takes the six
    outputs. The norm-weight gradients are bitwise repeatable (fixed-order sums); the weight
    gradients as the GEMM core's split-K is (fixed order).

    Five launches in three host calls (module docstring); dq and dk pass through global memory
    ([T, heads * d] bf16, allocated per call)."""
    import torch

    from .gemm_grouped import matmul_nt_grouped, matmul_nt_summed

    del rms_norm_eps
    inputs = (grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight, q_norm_weight,
              k_norm_weight, query_transposed, key_transposed, q_rstd, k_rstd, q_normed, k_normed)
    try:
        entry = _entries[grad_query.shape[3], grad_query.get_device()]
    except (AttributeError, IndexError, TypeError, KeyError):
        _check_inputs(*inputs)  # a new head size or device: full checks before the first build
        entry = _entries.setdefault((grad_query.shape[3], grad_query.get_device()),
                                    _Entry(grad_query.shape[3], grad_query.device))
    batch, seq, hidden = hidden_states.shape
    q_heads, head_dim, tokens = grad_query.shape[1], grad_query.shape[3], batch * seq
    if not (type(out) is tuple and len(out) == 6):
        out = _outputs(out, hidden_states, q_weight, k_weight, v_weight, head_dim)
    grad_hidden, grad_wq, grad_wk, grad_wv, grad_q_norm, grad_k_norm = out
    if tokens == 0:
        _check_inputs(*inputs)
        for t in out:
            t.zero_()
        return out
    try:
        # dq, dk as the projections' [T, heads * d] rows (the kernel sees [b, s, heads, d]); the
        # FFI call checks every per-head tensor's extents against them in C
        dq = torch.empty((batch, seq, q_heads, head_dim), dtype=torch.bfloat16, device=hidden_states.device)
        dk = torch.empty((batch, seq, 1, head_dim), dtype=torch.bfloat16, device=hidden_states.device)
        ctas = min(entry.max_ctas, -(-tokens * (q_heads + 1) // WARPS))
        partials = entry.partials.get()
        entry.run(grad_query, query_transposed, q_rstd, q_normed, q_norm_weight, dq, grad_key, key_transposed,
                  k_rstd, k_normed, k_norm_weight, dk, partials[:ctas, :head_dim], partials[:ctas, head_dim:],
                  grad_q_norm, grad_k_norm, ctas)
        rows_q, rows_k, rows_v = dq.view(tokens, -1), dk.view(tokens, -1), grad_value.view(tokens, head_dim)
        matmul_nt_summed([(rows_q, q_weight.t()), (rows_k, k_weight.t()), (rows_v, v_weight.t())],
                         out=grad_hidden.view(tokens, hidden))
        matmul_nt_grouped([rows_q.t(), rows_k.t(), rows_v.t()], hidden_states.view(tokens, hidden).t(),
                          outs=[grad_wq, grad_wk, grad_wv])
    except Exception:
        # a rejected argument: say which one and why in our own words
        _check_inputs(*inputs)
        _outputs(out, hidden_states, q_weight, k_weight, v_weight, head_dim)
        raise
    return out
