"""The fused residual RMSNorm backward, one pass over the rows.

    g = fp32(grad_output);  gn = g * weight
    dx = rstd * (gn - normalized * sum_j(gn_j normalized_j) / H)
    grad_hidden_states = grad_residual = bf16(dx)
    grad_weight = sum over rows of g * normalized

With normalized given, x is not read. With normalized=None the kernel reads x instead,
normalized = x * rstd, and dx = rstd * (gn - x * rstd^2 * sum_j(gn_j x_j) / H), the same value.
Either way a row moves 10 bytes an element (bf16 grad_output, one fp32 row, two bf16 outputs).

Work split: a persistent grid of CTAs strides over the rows; a CTA owns one row at a time,
each thread a fixed set of 4-wide column vectors (16-byte fp32 / 8-byte bf16 accesses).
The next rows stream into a shared-memory ring by cp.async while the current one is
computed, and the row's values stay in registers between the dot product and the gradient
(one read of each input). The dot product is a warp shuffle plus a shared-memory exchange between warps,
double-buffered by row parity so one barrier per row suffices. Because a thread's columns
never change, it accumulates grad_weight for them in registers across all its CTA's rows;
each CTA writes one fp32 partial row, and `ColumnSum` adds the partials in a fixed order:
no float atomics, so grad_weight is bitwise repeatable. Both launches come from one host
function, so a call is one TVM-FFI call.

Up to ONE_LAUNCH_MAX_ROWS rows the op is one launch of one 16-CTA cluster instead: each CTA
leaves its partial row in shared memory and, after a cluster barrier, adds a slice of the
columns over all 16 partials through distributed shared memory, in CTA order (still bitwise
repeatable). No workspace and no second launch: at 128 rows the two-launch call is bound by
its host time, and a launch costs ~2.7 us of it (measured on the H200; docs/design-rmsnorm.md).
Where the device holds two such clusters at once, the launch is two of them: a cluster sits in
one GPC, whose path to memory set the one-cluster pace, and two GPCs stream twice the rows. The
second cluster hands its column sums to the first through global memory (a release/acquire
flag per CTA rank), which adds them after its own: a fixed order again.
"""
from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch
from cutlass import BFloat16, Float32, Int32

from . import errors, runtime
from .calls import KEY_ERRORS, CallCache
from .checks import check_hidden_size, check_row_strides, check_same_device, check_tensor
from .column_sum import ColumnSum
from .rows import (MAX_HIDDEN, VECTOR, alloc_ring, cp_async_atoms, element, fake_rows, fake_rstd, fetch_row,
                   load_remote_vector, read_row, ring_stages, row_sum, rows_view, thread_split, vector, wide_copy)

TARGET_VECTORS_PER_THREAD = 5  # H = 2560 -> 128 threads x 5 vectors, no predication
# The decoder layer's form (one CTA per SM, three-row ring): 640 threads x 2 vectors at H = 5120.
# Timed interleaved on the H200, us per pass at 7184 / 2048 / 613 / 256 rows: 127.2 / 42.9 /
# 14.6 / 11.4 against 138.4 / 46.2 / 15.4 / 11.6 at 256 x 5 (320 x 4 and 448 x 3 slower still;
# two or three CTAs per SM without a ring slower too). 7184 rows is 515 MB: 95% of copy bandwidth.
DECODER_VECTORS_PER_THREAD = 2
PREFETCH_MAX_BYTES = 56 * 1024  # ring size per CTA: four CTAs per SM still fit
MAX_STAGES = 4  # H = 2560: 3 stages (46 KB) on either path
# The one-launch path: 16 CTAs, a non-portable cluster size (the op asks the driver whether the
# device holds one, else it keeps two launches). Measured on the H200, per call with
# out=: 9.8-10.2 us at 128 rows, GPU-bound (9.1-9.3 us of graph replay; 8 CTAs took 15), where
# the two launches are host-bound at 10-17 us (their host time varies run to run). Its GPU time
# grows ~1 us per 16 rows: 10.7 us at 131 rows, 11.7 at 160, where the two launches measured
# 10.2-14 us; so it ends at 144 rows.
ONE_CLUSTER = 16
# Rows up to which the one-launch path runs, by its cluster count: the crossovers, measured on
# the H200 per call with out= around the Python call (CUDA-graph replay), with normalized: 128
# rows one cluster 10.2-10.4 us (8.9-9.2), two clusters 8.4 (8.5), two launches 10.2-11.0 (4.5:
# host-bound); 200 rows two clusters 10.1, two launches 10.5-11.1; 256 rows 11.4-11.6 against
# 10.9-11.0.
ONE_LAUNCH_MAX_ROWS = {1: 144, 2: 224}
# One CTA per SM on the one-launch path, so its ring may take most of the shared memory: the
# cluster's 16 SMs have to stream every row.
ONE_CLUSTER_RING_BYTES = 192 * 1024
ONE_CLUSTER_STAGES = 8


@dataclasses.dataclass(frozen=True)
class RowForm:
    """What a row pass reads and writes besides the norm's math: the fused residual RMSNorm
    backward's form by default. The decoder layer's two norms (kernels.decoder_layer_backward)
    take the gradient in fp32 (a product's output), x and the weight in bf16, rstd as
    rsqrt(variance + eps), and add the residual branch's bf16 gradient into their one output:
    out = bf16(residual_grad + dx).

    dx_from_x: where normalized is read, dx still comes from x, which is read as well (the
    decoder layer's contract); otherwise (the default form's) dx comes from normalized and x is
    not read. Without normalized the pass always reads x and takes dx from it.

    single_output: dx is written once (a plain RMSNorm's input gradient, `model_form`), not as
    the two summands' equal gradients.

    grad_weight: its dtype; the column sum rounds the fp32 sum once as it stores a bf16 one.

    adds_into_grad_weight: grad_weight += the sum (a gradient accumulating in place)."""
    grad: type = BFloat16
    x: type = Float32
    weight: type = Float32
    from_variance: bool = False
    residual_grad: bool = False
    dx_from_x: bool = False
    single_output: bool = False
    grad_weight: type = Float32
    adds_into_grad_weight: bool = False

    @property
    def writes_grad_residual(self) -> bool:
        return not (self.residual_grad or self.single_output)

    def reads_x(self, read_normalized: bool) -> bool:
        return self.dx_from_x or not read_normalized

    def key(self) -> tuple:
        """The build key's part: nothing for the default form, every field for another."""
        if self == RowForm():
            return ()
        fields = (self.grad.__name__, self.x.__name__, self.weight.__name__, self.from_variance,
                  self.residual_grad, self.dx_from_x, self.single_output)
        fields = fields if self.grad_weight is Float32 else (*fields, self.grad_weight.__name__)
        return (*fields, "adds") if self.adds_into_grad_weight else fields


class FusedResidualRmsNormBackward:
    def __init__(self, hidden: int, read_normalized: bool, clusters: int = 0, form: RowForm = RowForm()):
        """clusters: 0 for the grid path (row kernel + column sum), 1 or 2 for one launch of
        that many 16-CTA clusters (the default form only)."""
        if hidden % VECTOR:
            raise ValueError(f"hidden size {hidden} must be a multiple of {VECTOR}")
        self.hidden = hidden
        self.read_normalized = read_normalized
        self.form = form
        self.reads_x = form.reads_x(read_normalized)
        self.clustered = clusters > 0  # the one-launch path: CTAs in clusters, sums across them
        self.clusters = clusters
        self.threads, self.vectors_per_thread, self.warps = thread_split(
            hidden, DECODER_VECTORS_PER_THREAD if form.residual_grad else TARGET_VECTORS_PER_THREAD)
        # The cp.async ring holds `stages` rows of every input (as many as fit in the budget, up
        # to MAX_STAGES) so the next rows load while this one is computed; measured: +2 to 3
        # points at mid sizes, nothing at the largest (docs/design-rmsnorm.md). Too big a row:
        # no ring.
        row_bytes = hidden * (form.grad.width // 8 + (form.x.width // 8 if self.reads_x else 0)
                              + (4 if read_normalized else 0) + (2 if form.residual_grad else 0))
        self.stages = ring_stages(row_bytes, PREFETCH_MAX_BYTES, MAX_STAGES) if not self.clustered else \
            ring_stages(row_bytes, ONE_CLUSTER_RING_BYTES - 4 * hidden, ONE_CLUSTER_STAGES)
        if form.residual_grad:
            # The decoder layer's rows are 12 bytes an element (61 KB at H = 5120, over the grid's
            # ring budget) and its grid is one CTA per SM (_FormEntry), so the ring may take most
            # of the shared memory, as on the one-launch path: three rows (measured at 7184 rows:
            # two rows took the same at 256 threads, 133.8 against 146.1 us at 448).
            self.stages = ring_stages(row_bytes, ONE_CLUSTER_RING_BYTES, MAX_STAGES)
        # rstd through the ring as well, where there is one: with one CTA per SM an exposed rstd
        # load per row set the one-cluster path's pace (12.2 -> 9.3 us at 128 rows); on the grid
        # path it cost up to 7% (normalized=None, 8192 rows), four CTAs per SM hiding that load.
        self.rstd_in_ring = self.clustered and self.stages > 0
        self.column_sum = ColumnSum(hidden, adds=form.adds_into_grad_weight)

    @cute.jit
    def __call__(self, grad_output: cute.Tensor, x: cute.Tensor | None, normalized: cute.Tensor | None,
                 rstd: cute.Tensor, weight: cute.Tensor, grad_hidden: cute.Tensor,
                 grad_residual: cute.Tensor | None, grad_weight: cute.Tensor, workspace: cute.Tensor,
                 ctas: Int32, residual_grad: cute.Tensor | None, eps: Float32 | None, stream: cuda.CUstream):
        """Both launches in one host function, so one FFI call: the row kernel writes `ctas`
        partial rows of `workspace`, the column sum adds them into grad_weight. The decoder
        layer's form: `rstd` holds the variance, `eps` is given, grad_residual is None and
        `residual_grad` is added into grad_hidden; the default form passes None for both. x is
        None where the form does not read it (the default form with normalized)."""
        m_x, m_norm = self.row_views(x, normalized)
        partials = cute.make_tensor(workspace.iterator, cute.make_layout(
            (ctas, self.hidden), stride=(cute.assume(workspace.stride[0], divby=VECTOR), 1)))
        m_gr, m_add = None, None
        if cutlass.const_expr(grad_residual is not None):
            m_gr = rows_view(grad_residual)
        if cutlass.const_expr(residual_grad is not None):
            m_add = rows_view(residual_grad)
        self.kernel(rows_view(grad_output), m_x, m_norm, rows_view(rstd)[None, 0], weight,
                    rows_view(grad_hidden), m_gr, partials, None, m_add, eps).launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True)
        self.column_sum(partials, grad_weight, stream)

    @cute.jit
    def one_launch(self, grad_output: cute.Tensor, x: cute.Tensor | None, normalized: cute.Tensor | None,
                   rstd: cute.Tensor, weight: cute.Tensor, grad_hidden: cute.Tensor,
                   grad_residual: cute.Tensor, grad_weight: cute.Tensor, handoff: cute.Tensor | None,
                   stream: cuda.CUstream):
        """The one-launch path (built with clusters = 1 or 2): grad_weight summed across the
        cluster(s). With two clusters `handoff` is a zeroed fp32 [H + 16] buffer: the second
        cluster's column sums, then one flag per CTA rank, which the kernel leaves at zero."""
        m_x, m_norm = self.row_views(x, normalized)
        self.kernel(rows_view(grad_output), m_x, m_norm, rows_view(rstd)[None, 0], weight,
                    rows_view(grad_hidden), rows_view(grad_residual), grad_weight, handoff, None, None).launch(
            grid=[ONE_CLUSTER * self.clusters, 1, 1], block=[self.threads, 1, 1], cluster=[ONE_CLUSTER, 1, 1],
            stream=stream, use_pdl=True)

    def row_views(self, x, normalized):
        """(x, normalized) as row views, None for either the pass does not read."""
        m_x = rows_view(x) if self.reads_x else None
        m_norm = rows_view(normalized) if self.read_normalized else None
        return m_x, m_norm

    @cute.kernel
    def kernel(self, m_go: cute.Tensor, m_x, m_norm, m_rstd: cute.Tensor,
               m_w: cute.Tensor, m_gh: cute.Tensor, m_gr, m_part: cute.Tensor, m_handoff, m_add, eps):
        # A programmatic dependent launch: its CTAs take their SMs as the kernel before retires and
        # wait here, before any global access, for that kernel's writes. Measured on the H200
        # (timed as tools/bench times): -1 to -1.8 us a call at every size (the largest within
        # noise), 1024 x 8 90.4 -> 92.6% of copy bandwidth. Triggering the next call's row kernel
        # early (from the column sum's start) lost up to 7% instead: its CTAs then land on SMs
        # beside the column sum's, not evenly GRID_CTAS_PER_SM to an SM.
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        lane, warp = tidx % 32, tidx // 32
        h, vpt, threads = self.hidden, self.vectors_per_thread, self.threads
        rows = cute.size(m_go, mode=[0])
        my_rows = cute.ceil_div(rows - bidx, ctas)  # rows bidx, bidx + ctas, ...; at least one

        smem = cutlass.memory.SmemAllocator()
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2)), byte_alignment=16)
        load_bf16, load_f32 = wide_copy(BFloat16), wide_copy(Float32)
        weight = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        grad_weight = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        g = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        xs = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        ns = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        staging_bf16 = cute.make_rmem_tensor((VECTOR,), BFloat16)
        staging_f32 = cute.make_rmem_tensor((VECTOR,), Float32)
        adds = cute.make_rmem_tensor((VECTOR, vpt), Float32)
        # Inputs of a row, in the order fetch_row/read_row take them, and the registers they land in.
        sources, values = (m_go,), (g,)
        if cutlass.const_expr(self.reads_x):
            sources, values = (*sources, m_x), (*values, xs)
        if cutlass.const_expr(self.read_normalized):
            sources, values = (*sources, m_norm), (*values, ns)
        if cutlass.const_expr(self.form.residual_grad):
            sources, values = (*sources, m_add), (*values, adds)
        # The row dx is taken from: x (its scale then carries rstd^2, as normalized = x * rstd)
        # where x is read, else normalized.
        dx_row = xs if cutlass.const_expr(self.reads_x) else ns
        for t in (grad_weight, weight, *values):
            t.fill(0.0)
        read_row((load_bf16, load_f32), (m_w,), (weight,), tidx, threads, vpt, h // VECTOR)

        if cutlass.const_expr(self.stages > 0):
            # Ring in shared memory: rows it + 1 .. it + S - 1 stream in (cp.async) while row it is
            # computed. Each thread copies and later reads only its own vectors, so the ring
            # needs no barrier, just the thread's own cp.async groups (one per row).
            # rstd (where it rides in the ring) has one copy per thread, so still no barrier.
            ring = self.stages
            stages = alloc_ring(smem, sources, h, ring)
            rstd_ring = None
            if cutlass.const_expr(self.rstd_in_ring):
                rstd_ring = smem.allocate_tensor(Float32, cute.make_layout((threads, ring)), byte_alignment=16)
            fetches = cp_async_atoms()
            for j in cutlass.range_constexpr(ring - 1):
                if j < my_rows:
                    self.fetch(fetches, sources, m_rstd, bidx + j * ctas, stages, rstd_ring, j, tidx)
                cute.arch.cp_async_commit_group()

        for it in cutlass.range(0, my_rows):
            row = bidx + it * ctas
            if cutlass.const_expr(self.form.from_variance):
                rstd = cute.math.rsqrt(m_rstd[row] + eps)
            elif cutlass.const_expr(not self.rstd_in_ring):
                rstd = m_rstd[row]
            if cutlass.const_expr(self.stages > 0):
                # The slot refilled here held row it - 1, which this thread has already read.
                if it + ring - 1 < my_rows:
                    self.fetch(fetches, sources, m_rstd, row + (ring - 1) * ctas, stages, rstd_ring,
                               (it + ring - 1) % ring, tidx)
                cute.arch.cp_async_commit_group()  # possibly empty: keeps one group per row
                cute.arch.cp_async_wait_group(ring - 1)  # this row's group has landed
                if cutlass.const_expr(self.rstd_in_ring):
                    rstd = rstd_ring[tidx, it % ring]
                read_row((load_bf16, load_f32), tuple(s[None, it % ring] for s in stages), values,
                          tidx, threads, vpt, h // VECTOR)
            else:
                read_row((load_bf16, load_f32), tuple(s[row, None] for s in sources), values,
                          tidx, threads, vpt, h // VECTOR)
            dot = Float32(0.0)
            for k in cutlass.range_constexpr(vpt):
                gk = g[None, k].load()
                if cutlass.const_expr(self.read_normalized):
                    normalized = ns[None, k].load()
                else:
                    normalized = xs[None, k].load() * rstd
                grad_weight[None, k].store(grad_weight[None, k].load() + gk * normalized)
                dot += (gk * weight[None, k].load() * dx_row[None, k].load()).reduce(
                    cute.ReductionOp.ADD, Float32(0.0), 0)
            total = row_sum(dot, warp_sums, it % 2, lane, warp, self.warps)
            if cutlass.const_expr(self.reads_x):
                scale = rstd * rstd * total * (1.0 / h)
            else:
                scale = total * (1.0 / h)
            for k in cutlass.range_constexpr(vpt):
                if tidx + k * threads < h // VECTOR:  # uneven rows leave the last vectors idle
                    gk = g[None, k].load()
                    dx = rstd * (gk * weight[None, k].load() - dx_row[None, k].load() * scale)
                    if cutlass.const_expr(self.form.residual_grad):
                        dx = dx + adds[None, k].load()
                    staging_bf16.store(dx.to(BFloat16))
                    cute.copy(load_bf16, staging_bf16, vector(m_gh[row, None], tidx + k * threads))
                    if cutlass.const_expr(m_gr is not None):
                        cute.copy(load_bf16, staging_bf16, vector(m_gr[row, None], tidx + k * threads))

        if cutlass.const_expr(self.clustered):
            self.add_across_clusters(grad_weight, m_part, m_handoff, smem, tidx, bidx)
        else:
            # Let the column sum launch now; its griddepcontrol.wait still waits for these partials.
            cute.arch.griddepcontrol_launch_dependents()
            for k in cutlass.range_constexpr(vpt):
                if tidx + k * threads < h // VECTOR:  # uneven rows leave the last vectors idle
                    staging_f32.store(grad_weight[None, k].load())
                    cute.copy(load_f32, staging_f32, vector(m_part[bidx, None], tidx + k * threads))

    @cute.jit
    def fetch(self, fetches, sources, m_rstd, row, stages, rstd_ring, slot, tidx):
        """cp.async this thread's vectors of `row` of every input (and, where it rides in the
        ring, its own copy of the row's rstd) into ring slot `slot`."""
        fetch_row(fetches, tuple(s[row, None] for s in sources), stages, slot, tidx, self.threads,
                  self.vectors_per_thread, self.hidden // VECTOR)
        if cutlass.const_expr(self.rstd_in_ring):
            cute.copy(fetches[2], element(m_rstd, row), element(rstd_ring[tidx, None], slot))

    @cute.jit
    def add_across_clusters(self, grad_weight: cute.Tensor, m_out: cute.Tensor, m_handoff, smem, tidx, bidx):
        """m_out = the sum of every CTA's grad_weight partial, in a fixed order. Within a cluster
        each CTA leaves its partial in shared memory and adds a slice of the columns over all
        16 of them through distributed shared memory, in rank order. (Measured against pushing
        the slices to their owners with st.async and an mbarrier, which needs no release fence:
        9.1 against 10.0 us at 128 rows.) With two clusters, rank r of the second stores its
        slice in `m_handoff` and raises flag r (a release); rank r of the first, owning the same
        slice, waits for that flag (an acquire), adds the stored slice after its own and lowers
        the flag for the next call."""
        vectors, threads = self.hidden // VECTOR, self.threads
        # One column vector per thread at most: thread_split gives <= 16 vectors a thread.
        assert vectors <= ONE_CLUSTER * threads
        rank, cluster = bidx % ONE_CLUSTER, bidx // ONE_CLUSTER
        partial = smem.allocate_tensor(Float32, cute.make_layout((self.hidden,)), byte_alignment=16)
        for k in cutlass.range_constexpr(self.vectors_per_thread):
            if tidx + k * threads < vectors:
                vector(partial, tidx + k * threads).store(grad_weight[None, k].load())
        cute.arch.cluster_arrive()  # release: this CTA's partial is written
        cute.arch.cluster_wait()  # acquire: every CTA's partial is readable
        v = rank * threads + tidx
        acc = cute.make_rmem_tensor((VECTOR,), Float32)
        acc.fill(0.0)
        if v < vectors:
            for r in cutlass.range_constexpr(ONE_CLUSTER):
                values = load_remote_vector(vector(partial, v).iterator, r)
                for e in cutlass.range_constexpr(VECTOR):
                    acc[e] = acc[e] + values[e]
        if cutlass.const_expr(self.clusters == 1):
            if v < vectors:
                cute.copy(wide_copy(Float32), acc, vector(m_out, v))
        else:
            flag = m_handoff.iterator + self.hidden + rank
            if cluster == 1:
                if v < vectors:
                    cute.copy(wide_copy(Float32), acc, vector(m_handoff, v))
                cute.arch.barrier()  # every thread's slice is stored before the flag goes up
                if tidx == 0:
                    cute.arch.store(flag, Int32(1), sem="release", scope="gpu")
            else:
                if tidx == 0:
                    raised = Int32(0)
                    while raised == 0:
                        raised = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
                cute.arch.barrier()  # the flag's acquire orders every thread's reads below
                if v < vectors:
                    other = cute.make_rmem_tensor((VECTOR,), Float32)
                    cute.copy(wide_copy(Float32), vector(m_handoff, v), other)
                    acc.store(acc.load() + other.load())
                    cute.copy(wide_copy(Float32), acc, vector(m_out, v))
                cute.arch.barrier()  # every thread has read the slice before the flag comes down
                if tidx == 0:
                    cute.arch.store(flag, Int32(0), sem="relaxed", scope="gpu")
        # No CTA may exit (freeing its shared memory) while another still reads its partial. The
        # reads have returned (their sums are stored), so the arrive needs no release fence.
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()


# The grid's CTAs per SM (4 fit: 128 threads x ~125 registers, <= 56 KB of ring). A whole number
# keeps every SM's share of the rows equal. Measured on the H200 at H = 2560, 10 bytes an element
# (us, 8192 x 64 / 4096 x 32 / 1721 x 64): 3 a SM 3289 / 817 / 687; 3.5 3344 / 829 / 696; 4 3316 /
# 833 / 703; 2.5 3500 / 874 / 734; the ring's depth (2 to 4 rows) changed nothing.
GRID_CTAS_PER_SM = 3
# Up to MID_ROWS rows the grid is 3.5 CTAs a SM instead (half the SMs hold four): more rows in
# flight where the call is short. Measured (us, GPU time): 1801 x 1 16.8 -> 16.3, 853 x 4 27.9
# -> 27.4, 1024 x 8 57.2 -> 56.3, 997 x 16 104.5 -> 103.6; above it 1087 x 32 220.0 -> 223.3.
MID_CTAS_PER_SM, MID_ROWS = 3.5, 16384


def _fake_args(hidden: int, read_normalized: bool, clusters: int = 0, form: RowForm = RowForm()):
    """Compile-time stand-ins for the call's tensors. batch and seq are shared symbols, so each
    call checks in C that every [b, s, ...] tensor agrees; strides are free (multiples of VECTOR
    elements, so every row start is vector aligned); H is static."""
    batch, seq, workspace_rows = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    rows_of = lambda dtype: fake_rows(dtype, batch, seq, hidden)
    rstd = fake_rstd(batch, seq)
    weight = runtime.fake_tensor(form.weight, (hidden,), (1,), VECTOR * form.weight.width // 8)
    grad_weight = runtime.fake_tensor(form.grad_weight, (hidden,), (1,), 16)
    workspace = runtime.fake_tensor(Float32, (workspace_rows, hidden), (cute.sym_int64(divisibility=VECTOR), 1), 16)
    x = rows_of(form.x) if form.reads_x(read_normalized) else None
    normalized = rows_of(Float32) if read_normalized else None
    grad_residual = rows_of(BFloat16) if form.writes_grad_residual else None
    tensors = (rows_of(form.grad), x, normalized, rstd, weight, rows_of(BFloat16),
               grad_residual, grad_weight)
    if clusters == 0:
        extras = (rows_of(BFloat16), Float32(0.0)) if form.residual_grad else (None, None)
        assert form.residual_grad == form.from_variance, "056's form has both, 013's neither"
        return (*tensors, workspace, Int32(1), *extras)
    handoff = runtime.fake_tensor(Float32, (hidden + ONE_CLUSTER,), (1,), 16) if clusters == 2 else None
    return (*tensors, handoff)


def _build(hidden: int, read_normalized: bool, arch: str, dump_dir=None, clusters: int = 0,
           form: RowForm = RowForm()):
    """The compiled op for one hidden size: row kernel + column sum in one host function, or
    with `clusters` (1 or 2) the one-launch path; batch, seq, strides and the CTA count are
    runtime values."""
    op = FusedResidualRmsNormBackward(hidden, read_normalized, clusters, form)
    return runtime.compile_kernel(
        ("fused_residual_rmsnorm_backward", hidden, read_normalized, clusters, *form.key()),
        op.one_launch if clusters else op, *_fake_args(hidden, read_normalized, clusters, form),
        runtime.env_stream(), arch=arch, dump_dir=dump_dir, tvm_ffi=True)


def _check_inputs(grad_output, x, normalized, rstd, weight):
    """The full argument check, with messages that name the argument. Run on a shape's first call
    and to explain any call the compiled function's own (C) checks reject."""
    check_tensor("grad_output", grad_output, dtypes=torch.bfloat16, ndim=3, contiguous=False, align=8)
    batch, seq, hidden = grad_output.shape
    check_hidden_size("grad_output", hidden, MAX_HIDDEN)
    # The one fp32 row input: normalized where given (x is then not read, so not checked), else x.
    name, row = ("x", x) if normalized is None else ("normalized", normalized)
    check_tensor(name, row, dtypes=torch.float32, shape=(batch, seq, hidden), contiguous=False)
    check_row_strides("grad_output", grad_output, VECTOR)
    check_row_strides(name, row, VECTOR)
    check_tensor("rstd", rstd, dtypes=torch.float32, shape=(batch, seq, 1), contiguous=False, align=4)
    check_tensor("weight", weight, dtypes=torch.float32, shape=(hidden,))
    check_same_device(grad_output=grad_output, **{name: row}, rstd=rstd, weight=weight)
    if batch * seq >= 2**31:
        raise ValueError(f"grad_output: {batch * seq} rows; at most 2^31 - 1 are supported")
    return batch, seq, hidden


def _check_out(out, grad_output):
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError("out: expected (grad_hidden_states, grad_residual, grad_weight)")
    batch, seq, hidden = grad_output.shape
    for name, t in zip(("grad_hidden_states", "grad_residual"), out[:2]):
        check_tensor(f"out[{name}]", t, dtypes=torch.bfloat16, shape=(batch, seq, hidden), align=8)
    check_tensor("out[grad_weight]", out[2], dtypes=torch.float32, shape=(hidden,))
    check_same_device(grad_output=grad_output, grad_hidden_states=out[0], grad_residual=out[1],
                      grad_weight=out[2])
    return tuple(out)


class _Entry:
    """What one (hidden size, normalized given?, device) needs per call, resolved once."""

    def __init__(self, hidden: int, read_normalized: bool, device):
        self.device, self.hidden = device, hidden
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_ctas = int(GRID_CTAS_PER_SM * sms)
        self.mid_ctas = int(MID_CTAS_PER_SM * sms)
        arch = runtime.device_arch(device.index)
        self.run = runtime.ffi_function(_build(hidden, read_normalized, arch))
        # The one-launch path: two clusters where the device holds two at once (each CTA has
        # an SM to itself), else one, else none.
        self.clusters = min(2, runtime.max_clusters(device, ONE_CLUSTER))
        self.one_launch_max_rows = ONE_LAUNCH_MAX_ROWS.get(self.clusters, 0)
        self.run_one_launch = runtime.ffi_function(_build(hidden, read_normalized, arch, clusters=self.clusters)) \
            if self.clusters else None
        # the second cluster's hand-off: zeroed once, and each call leaves its flags at zero
        self.handoff = _ZeroedWorkspace(1, hidden + ONE_CLUSTER, device) if self.clusters == 2 else None
        # partial-sum rows of grad_weight, one buffer per stream
        self.workspace = runtime.StreamWorkspace(self.mid_ctas, hidden, device)


class _ZeroedWorkspace(runtime.StreamWorkspace):
    """A per-stream fp32 [cols] buffer that starts at zero."""

    def _new(self):
        return super()._new()[0].zero_()


def _call_key(grad_output, x, normalized, rstd, weight):
    _, _, hidden = grad_output.shape
    return hidden, normalized is None, grad_output.get_device()


def _new_entry(key, grad_output, x, normalized, rstd, weight):
    return _Entry(key[0], normalized is not None, grad_output.device)


_calls = CallCache(_call_key, _check_inputs, _new_entry)


def fused_residual_rmsnorm_backward(grad_output, x, normalized, rstd, weight, *, out=None):
    """The fused residual RMSNorm backward: -> (grad_hidden_states, grad_residual, grad_weight),
    as semantics.md says.

    grad_output, x, normalized [b, s, H] with any batch/seq strides that are multiples of 4
    elements and a contiguous last dim (bf16, fp32, fp32); rstd fp32 [b, s, 1]; weight fp32
    [H]; H a multiple of 8 up to 16384. With normalized given, x is not read (nor checked: it
    may be None). normalized=None: the kernel reads x and computes normalized = x * rstd; the
    caller guarantees that is what normalized would be. Either way 10 bytes an element move.
    out=(grad_hidden_states, grad_residual, grad_weight) writes into the caller's tensors.
    grad_weight is bitwise repeatable: per-CTA partial sums added in a fixed order.

    Host cost: one dict lookup, the output allocations (none with out=) and one TVM-FFI call,
    which checks dtypes, shapes, strides, alignment and device in C and makes the launches
    (one up to ONE_LAUNCH_MAX_ROWS rows, two above);
    the Python checks run on a shape's first call and to explain a rejected call. Each CUDA
    stream keeps a [3.5 x SMs, H] fp32 workspace for the partial sums (a partial row a CTA: about
    4.7 MB at H = 2560 on an H200).
    """
    try:
        entry = _calls[_call_key(grad_output, x, normalized, rstd, weight)]
    except KEY_ERRORS:
        entry = _calls.first_call(grad_output, x, normalized, rstd, weight)
    errors.raise_pending(entry.device.index)
    batch, seq, hidden = grad_output.shape
    rows = batch * seq
    if out is None:
        # new_empty takes dtype and device from its tensor (both checked by the FFI call): measured
        # 7 us of host time for the three at 128 rows, against 16 us for torch.empty with keywords.
        out = (grad_output.new_empty((batch, seq, hidden)), grad_output.new_empty((batch, seq, hidden)),
               weight.new_empty(hidden))
    elif not isinstance(out, tuple) or len(out) != 3:
        out = _check_out(out, grad_output)
    grad_hidden, grad_residual, grad_weight = out
    if rows == 0 or rows >= 2**31:
        _check_inputs(grad_output, x, normalized, rstd, weight)
        _check_out(out, grad_output)
        grad_weight.zero_()
        return out
    x_read = x if normalized is None else None  # with normalized the build takes no x
    try:
        if rows <= entry.one_launch_max_rows:
            entry.run_one_launch(grad_output, x_read, normalized, rstd, weight, grad_hidden, grad_residual, grad_weight,
                                 entry.handoff.get() if entry.handoff else None)
        else:
            entry.run(grad_output, x_read, normalized, rstd, weight, grad_hidden, grad_residual, grad_weight,
                      entry.workspace.get(), min(rows, entry.mid_ctas if rows <= MID_ROWS else entry.max_ctas),
                      None, None)
    except Exception:
        # The C-side checks rejected an argument; say which one and why in our own words.
        _check_inputs(grad_output, x, normalized, rstd, weight)
        _check_out(out, grad_output)
        raise
    return out


# The decoder layer's two norms (decoder_layer_backward): the gradient is an fp32 product output, x
# and the weight bf16, rstd from the variance, the residual branch's gradient added into one output,
# dx from x (normalized read for grad_weight only).
DECODER_FORM = RowForm(grad=Float32, x=BFloat16, weight=BFloat16, from_variance=True, residual_grad=True,
                       dx_from_x=True)


class _FormEntry:
    """A RowForm's grid path for one (hidden size, device), resolved once."""

    def __init__(self, form: RowForm, hidden: int, device, read_normalized: bool, ctas_per_sm: int):
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_ctas = ctas_per_sm * sms
        self.run = runtime.ffi_function(_build(hidden, read_normalized, runtime.device_arch(device.index), form=form))
        self.workspace = runtime.StreamWorkspace(self.max_ctas, hidden, device)


_form_entries: dict = {}  # (form tag, hidden, device index) -> _FormEntry


def _form_entry(tag, make_form, x, read_normalized: bool, ctas_per_sm: int) -> _FormEntry:
    """The entry of the form `tag` names for x's hidden size and device, made on its first call
    from make_form(): a tag hashes faster than the RowForm, and this lookup is on every call."""
    key = (tag, x.shape[-1], x.get_device())
    entry = _form_entries.get(key)
    if entry is None:
        entry = _form_entries[key] = _FormEntry(make_form(), x.shape[-1], x.device, read_normalized, ctas_per_sm)
    return entry


def residual_norm_backward(grad, x, normalized, variance, eps: float, weight, residual_grad, out, grad_weight):
    """The decoder layer's norm backward with its residual branch, one pass over the rows
    (DECODER_FORM):

        out = bf16(residual_grad + rms_dx(grad * weight, x, rsqrt(variance + eps)))
        grad_weight = sum over rows of grad * normalized

    grad fp32, x bf16, normalized fp32, residual_grad and out bf16, all [b, s, H] (H a multiple
    of 8, row starts 16-byte aligned); variance fp32 [b, s, 1]; weight bf16 [H]; grad_weight fp32
    [H], bitwise repeatable (per-CTA partials added in a fixed order). The caller checks dtypes and
    shapes; the C entry point checks them again with strides and alignment."""
    batch, seq, _ = x.shape
    # one CTA per SM: its ring takes most of the shared memory
    entry = _form_entry("decoder", lambda: DECODER_FORM, x, True, 1)
    rows = batch * seq
    if rows == 0:
        grad_weight.zero_()
        return
    entry.run(grad, x, normalized, variance, weight, out, None, grad_weight, entry.workspace.get(),
              min(rows, entry.max_ctas), residual_grad, eps)


# A model's RMSNorm layer (kernels/modules.py rms_norm): bf16 gradient and input, rstd given, dx
# written once, normalized = x * rstd (x is what the forward saves). The weight (w, or Gemma's
# fp32 1 + w) and its gradient in the model's dtypes, bf16 or fp32, so the backward makes no
# casts: a small model's backward is bound by host time, a launch each.
def model_form(weight, grad_weight, adds: bool = False) -> RowForm:
    """The model form for a weight and a weight gradient of these CuTe types (BFloat16 or Float32);
    `adds`: the gradient is added into grad_weight."""
    return RowForm(grad=BFloat16, x=BFloat16, weight=weight, single_output=True, grad_weight=grad_weight,
                   adds_into_grad_weight=adds)


def rmsnorm_backward(grad, x, rstd, weight, out, grad_weight, adds: bool = False):
    """A plain RMSNorm's backward, one pass over the rows (model_form):

        out = bf16(rms_dx(grad * weight, x, rstd));  grad_weight = sum over rows of grad * x * rstd

    grad, x and out bf16 [b, s, H] (H a multiple of 8, row starts 16-byte aligned); rstd fp32
    [b, s, 1]; weight and grad_weight [H], each bf16 or fp32; grad_weight is the fp32 sum rounded
    once, bitwise repeatable (`adds`: grad_weight += that sum, rounded once, for a gradient that
    accumulates in place). The caller checks dtypes and shapes (kernels/modules.py); the C entry
    point checks them again with strides and alignment."""
    entry = _form_entry((weight.dtype, grad_weight.dtype, adds), lambda: model_form(
        runtime.cute_dtype(weight.dtype), runtime.cute_dtype(grad_weight.dtype), adds), x, False, GRID_CTAS_PER_SM)
    batch, seq, _ = x.shape
    rows = batch * seq
    if rows == 0:
        if not adds:
            grad_weight.zero_()
        return
    entry.run(grad, x, None, rstd, weight, out, None, grad_weight, entry.workspace.get(), min(rows, entry.max_ctas),
              None, None)


AUDIT_BUILDS = {
    f"fused_residual_rmsnorm_backward[H={h},{'normalized' if rn else 'normalized=None'}]":
        (lambda arch, dump_dir, h=h, rn=rn: _build(h, rn, arch, dump_dir))
    for h, rn in ((2560, True), (2560, False), (1000, True))
}
AUDIT_BUILDS.update({
    f"fused_residual_rmsnorm_backward[H={h},{'normalized' if rn else 'normalized=None'},{c} cluster{'s' * (c > 1)}]":
        (lambda arch, dump_dir, h=h, rn=rn, c=c: _build(h, rn, arch, dump_dir, clusters=c))
    for h, rn in ((2560, True), (2560, False)) for c in (1, 2)
})
AUDIT_BUILDS["fused_residual_rmsnorm_backward[H=5120,056 form]"] = \
    lambda arch, dump_dir: _build(5120, True, arch, dump_dir, form=DECODER_FORM)
AUDIT_BUILDS.update({  # Qwen3-4B's layer norms (bf16 weight) and Q/K norms over head_dim 128; Gemma's 1 + w
    f"rmsnorm_backward[H={h},model form,{w.__name__} weight]":
        (lambda arch, dump_dir, h=h, w=w: _build(h, False, arch, dump_dir, form=model_form(w, BFloat16)))
    for h, w in ((2560, BFloat16), (128, BFloat16), (640, Float32))
})
AUDIT_BUILDS.update({  # the same adding into an accumulating bf16 gradient
    f"rmsnorm_backward[H={h},model form,{w.__name__} weight,adds]":
        (lambda arch, dump_dir, h=h, w=w: _build(h, False, arch, dump_dir, form=model_form(w, BFloat16, adds=True)))
    for h, w in ((2560, BFloat16), (640, Float32))
})
# Rows stream in through cp.async (LDGSTS); 128-bit loads of weight and the partials; no
# local-memory spills, no atomics (grad_weight's order is fixed).
# The one-cluster builds launch 16 CTAs per cluster (non-portable: the op asks the driver first).
AUDIT_EXPECTS = {arch: {"require": ["LDG.128", "LDGSTS"], "forbid": ["LOCAL", "ATOM/RED"], "max_cluster_ctas": 16}
                 for arch in runtime.ARCHES}
