"""The QKV projection with Q/K RMSNorm backward (Gemma3): the GEMM core's summed and grouped
modes from one host call, in one launch at small T and two otherwise.

    launch 1, the summed product:
      prologue (every CTA, then a grid barrier)     dq, dk, per-CTA norm-weight partials
      main loop                                     grad_hidden_states = [dq dk dv] . [Wq; Wk; Wv]
      side job (the producer's idle warps)          grad_{q,k}_norm_weight = the partials' sums
    launch 2, the grouped product (PDL)             grad_{q,k,v}_weight = [dq dk dv]^T . hidden
    paired (sm_90a, where the CTAs the summed product leaves idle take the grouped product's
    tiles in two waves; paired_clusters): one launch, those CTAs run the grouped product past
    the same prologue and grid barrier (Sm90Gemm._launch_pair)

Why one host call and few launches: on the H200 host each torch view, transpose or allocation
costs ~3-6 us and each launch from a compiled host function ~4.3 us (the TVM-FFI call itself
well under 1 us), so the op as three host calls and five launches, with dq/dk allocated and
viewed in Python, spent ~140 us of host time on calls whose GPU time is 20-60 us. Here every
view is a CuTe layout built inside the compiled host function, dq/dk live in a per-stream
scratch buffer, and the norm rows and the norm-weight sums ride in the summed product (measured
on the H200, one process, mean a call over the 16 workloads with out=: four launches 50.6 us,
three 43.9-46.1, two 41.7).

dq and dk go through global memory (bf16, one [T, (heads + 1) * d] buffer: dq's columns, then
dk's). Making them inside the products' operand path instead, never written, measured slower on
Hopper, where the warps that issue the warpgroup MMAs would have to run the transform too; it
would need Blackwell, whose MMAs one thread issues (docs/design-qkv.md).

Compile-time: head_dim, q heads and the hidden size (a model's dimensions) and the two
products' tilings (picked per token count by the GEMM core's rules: three builds cover the 16
workloads); batch and sequence are runtime extents.
"""
from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32

from ..layouts.gemm import GemmTiling, default_tiling
from ..layouts.gpus import Gpu
from . import errors, runtime
from .calls import KEY_ERRORS, CallCache
from .checks import check_same_device, check_tensor
from .gemm import MAIN_LOOPS
from .gemm.core import BARRIER_WORDS, Launch
from .gemm.dispatch import Call, device_gpu
from .gemm.epilogue import STORE
from .gemm.grouped import stacked_k, stacked_rows
from .column_sum import ColumnSumsInWarps
from .qk_norm_rows import MAX_HEAD_DIM, VECTOR, QkNormBackward

PAIRED_ARCHS = ("sm_90a",)  # the GEMM core's launched pairs (Sm90Gemm._launch_pair): Hopper's, so far


def rows(t, count, width, stride, first: int = 0):
    """[count, width] rows of `stride` elements from t's element `first` (unit column stride)."""
    return cute.make_tensor(t.iterator + first, cute.make_layout((count, width), stride=(stride, 1)))


def transposed(t):
    """The [cols, rows] view of a 2-D tensor."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))


class QkvQkNormBackward:
    """The whole backward in one compiled host function, two launches: the summed product (A
    K-major, B = the weights read N-major in place), whose prologue makes dq, dk and the
    per-CTA partials and whose side job adds the partials into both norm-weight gradients;
    then the grouped product (A = dq/dk/dv read M-major, B = hidden_states read N-major); or
    both in one launch (`paired`)."""

    def __init__(self, head_dim: int, q_heads: int, hidden: int, arch: str, summed: GemmTiling,
                 grouped: GemmTiling, paired: bool = False):
        self.head_dim, self.q_heads, self.hidden, self.paired = head_dim, q_heads, hidden, paired
        self.norm = QkNormBackward(head_dim)
        main_loop = MAIN_LOOPS[arch].MAIN_LOOP
        # Both launches under programmatic dependent launch: a product's CTAs start (barriers,
        # descriptors) as the previous kernel's retire. The norm-weight gradients' column sums
        # run in the summed product's idle warps instead of a launch of their own. (H200, one
        # process, mean a call over the 16 workloads: 50.6 us with neither, 48.6 with PDL, 44.6
        # with both.)
        # Paired (Hopper, `paired_clusters`): the weight gradients read only the prologue's
        # dq/dk, so the CTAs the summed product's schedule leaves idle run them past the grid
        # barrier, in the same launch (so they too run the prologue and the side job).
        sums = ColumnSumsInWarps(2 * head_dim, head_dim)
        self.summed = main_loop.Summed(summed, True, False, BFloat16, STORE, pdl=True, side_job=sums,
                                       prologue=self.norm)
        both = {"side_job": sums, "prologue": self.norm} if paired else {}
        self.grouped = main_loop.Grouped(grouped, False, False, BFloat16, STORE, pdl=True, **both)

    @cute.jit
    def __call__(self, grad_q: cute.Tensor, rstd_q: cute.Tensor, normed_q: cute.Tensor, weight_q: cute.Tensor,
                 grad_k: cute.Tensor, rstd_k: cute.Tensor, normed_k: cute.Tensor, weight_k: cute.Tensor,
                 grad_v: cute.Tensor, hidden: cute.Tensor, w_q: cute.Tensor, w_k: cute.Tensor, w_v: cute.Tensor,
                 grad_hidden: cute.Tensor, grad_w_q: cute.Tensor, grad_w_k: cute.Tensor, grad_w_v: cute.Tensor,
                 grad_weight_q: cute.Tensor, grad_weight_k: cute.Tensor, dqk: cute.Tensor, norm_partials: cute.Tensor,
                 sum_partials: cute.Tensor, sum_flags: cute.Tensor, sum_ctas: Int32, sum_dp_tiles: Int32,
                 sum_per: Int32, group_partials: cute.Tensor, group_flags: cute.Tensor, group_ctas: Int32,
                 group_dp_tiles: Int32, group_per: Int32, arrivals: cute.Tensor, grid: Int32, stream):
        d, q_cols, width = self.head_dim, self.q_heads * self.head_dim, self.hidden
        batch, seq = hidden.shape[0], hidden.shape[1]
        tokens, row = batch * seq, q_cols + d
        # dq and dk as one [T, (heads + 1) * d] bf16 buffer; the norm rows see [b, s, heads, d]
        dq = cute.make_tensor(dqk.iterator, cute.make_layout((batch, seq, self.q_heads, d),
                                                             stride=(seq * row, row, d, 1)))
        dk = cute.make_tensor(dqk.iterator + q_cols,
                              cute.make_layout((batch, seq, 1, d), stride=(seq * row, row, d, 1)))
        partial_rows = rows(norm_partials, grid, 2 * d, 2 * d)  # one per CTA of the summed product
        prologue = self.norm.arguments(grad_q, rstd_q, normed_q, weight_q, dq, grad_k, rstd_k, normed_k, weight_k,
                                       dk, partial_rows)
        rows_q = rows(dqk, tokens, q_cols, row)
        rows_k = rows(dqk, tokens, d, row, first=q_cols)
        rows_v = rows(grad_v, tokens, d, d)  # the caller's rows are contiguous (checked on the host)
        x = rows(hidden, tokens, width, width)
        side_args = (partial_rows, grad_weight_q, grad_weight_k)
        with_prologue = {"side_args": side_args, "prologue_args": prologue, "arrivals": arrivals, "grid": grid}
        summed = Launch([rows_q, rows_k, rows_v], [transposed(w_q), transposed(w_k), transposed(w_v)],
                        [rows(grad_hidden, tokens, width, width)], sum_partials, sum_flags, sum_ctas, sum_dp_tiles,
                        sum_per, **with_prologue)
        grouped = Launch([transposed(rows_q), transposed(rows_k), transposed(rows_v)], [transposed(x)],
                         [grad_w_q, grad_w_k, grad_w_v], group_partials, group_flags, group_ctas, group_dp_tiles,
                         group_per)
        if cutlass.const_expr(self.paired):  # one launch: the grouped product runs the same prologue
            self.summed._launch_pair(self.grouped, summed, grouped._replace(**with_prologue), stream)
        else:
            self.summed._launch(summed, stream)
            self.grouped._launch(grouped, stream)


def _fake_args(head_dim: int, q_heads: int, hidden: int, summed: GemmTiling, grouped: GemmTiling):
    """Compile-time stand-ins: one batch and one seq symbol for every tensor (the call checks
    their extents agree in C); per-head tensors [b, heads, s, d] with free strides (multiples of
    8, unit last stride), rstd [b, heads, s, 1] any strides; [b, s, hidden] activations and
    grad_value [b, 1, s, d] with contiguous rows and a free batch stride (the host checks it is
    seq rows); weights and their gradients contiguous; the scratch buffers any length."""
    batch, seq, d = cute.sym_int32(), cute.sym_int32(), head_dim

    def per_head(heads):
        strides = (*(cute.sym_int64(divisibility=VECTOR) for _ in range(3)), 1)
        return runtime.fake_tensor(BFloat16, (batch, heads, seq, d), strides, 16)

    def side(heads):
        rstd = runtime.fake_tensor(Float32, (batch, heads, seq, 1), tuple(cute.sym_int64() for _ in range(4)), 4)
        return per_head(heads), rstd, per_head(heads), runtime.fake_tensor(BFloat16, (d,), (1,), 16)

    def activations():  # [b, s, hidden]: contiguous rows, a free batch stride
        return runtime.fake_tensor(BFloat16, (batch, seq, hidden), (cute.sym_int64(divisibility=VECTOR), hidden, 1), 16)

    # [b, 1, s, d]: contiguous rows, a free batch stride, any stride for the one head
    grad_value = runtime.fake_tensor(BFloat16, (batch, 1, seq, d),
                                     (cute.sym_int64(divisibility=VECTOR), cute.sym_int64(), d, 1), 16)

    def matrix(rows_):
        return runtime.fake_tensor(BFloat16, (rows_, hidden), (hidden, 1), 16)

    def flat(dtype, width):
        return runtime.fake_tensor(dtype, (cute.sym_int32(), width), (width, 1), 16)

    def schedule(tiling):  # as gemm.dispatch.Call passes it: stream-K partials and flags, ctas, dp tiles, per
        elements = tiling.tile_m * tiling.tile_n
        return (flat(Float32, elements), runtime.fake_tensor(Int32, (cute.sym_int32(),), (1,), 4), Int32(1),
                Int32(1), Int32(1))

    def grad_weight():
        return runtime.fake_tensor(Float32, (d,), (1,), 16)

    return (*side(q_heads), *side(1), grad_value, activations(),
            matrix(q_heads * d), matrix(d), matrix(d), activations(), matrix(q_heads * d), matrix(d), matrix(d),
            grad_weight(), grad_weight(), runtime.fake_tensor(BFloat16, (cute.sym_int32(),), (1,), 16),
            flat(Float32, 2 * d), *schedule(summed), *schedule(grouped),
            runtime.fake_tensor(Int32, (BARRIER_WORDS,), (1,), 4), Int32(1), runtime.env_stream())


def _build(head_dim: int, q_heads: int, hidden: int, summed: GemmTiling, grouped: GemmTiling, arch: str,
           dump_dir=None, paired: bool = False):
    summed, grouped = dataclasses.replace(summed, split_k=False), dataclasses.replace(grouped, split_k=False)
    return runtime.compile_kernel(("qkv_qknorm_backward", head_dim, q_heads, hidden, summed, grouped, paired),
                                  QkvQkNormBackward(head_dim, q_heads, hidden, arch, summed, grouped, paired),
                                  *_fake_args(head_dim, q_heads, hidden, summed, grouped),
                                  arch=arch, dump_dir=dump_dir, tvm_ffi=True)


def paired_clusters(arch: str, summed: GemmTiling, grouped: GemmTiling, rows: int, hidden: int,
                    idle_ctas: int):
    """The weight gradients' clusters when they run paired (Sm90Gemm._launch_pair: in the summed
    product's launch, past its grid barrier, on the CTAs its schedule leaves idle), or None to
    launch them after it. Paired only where the idle CTAs take all their tiles in two waves (a
    product that needs the busy SMs too would start its last tiles after the summed product all
    the same), and where both products' CTAs are alike (one CTA a cluster, the same warpgroups).

    H200, graph replay us, one process:
    - the weight gradients launched second and gated on the grid barrier, on the idle SMs,
      against after the summed product: 1x131 13.67 vs 16.17, 4x128 15.38 vs 17.43.
      On every SM instead (its CTAs start wherever a summed CTA retires): 1x131 15.77, 4x128
      17.92, 1x2048 28.30 vs 30.06, 1x1024 20.50 vs 20.06, 4x256 20.16 vs 19.75, 1x8192 87.0 vs
      83.3: so only where the idle SMs suffice (T <= 512 at Gemma's dims).
    - paired in one launch against gated: 1x131 11.99 -> 10.79, 2x128 11.89 -> 10.54, 4x128
      14.01 -> 13.52, 1x512 14.13 -> 13.46; host time a call with out= (the host slow that run)
      17.7 -> 13.9, 22.1 -> 14.5, 26.3 -> 21.6, 24.2 -> 19.4."""
    alike = (summed.cluster_m * summed.cluster_n == 1 == grouped.cluster_m * grouped.cluster_n
             and summed.mma_warpgroups == grouped.mma_warpgroups)
    if arch not in PAIRED_ARCHS or not alike:
        return None
    return idle_ctas if idle_ctas > 0 and 2 * idle_ctas >= grouped.cluster_tiles(rows, hidden) else None


def pairing(tokens: int, hidden: int, widths, gpu: Gpu):
    """(summed tiling, grouped tiling, paired_clusters' answer) at `tokens` on `gpu`: what a
    call picks (_Plan), and what the audit compiles without the device. Pairs are one CTA a
    cluster (paired_clusters), so the summed product's grid is one CTA an SM."""
    summed = summed_tiling(tokens, hidden, sum(widths), gpu)
    grouped = grouped_tiling(tokens, hidden, sum(widths), gpu)
    busy = min(gpu.sms, summed.cluster_tiles(tokens, hidden) * summed.cluster_m * summed.cluster_n)
    return summed, grouped, paired_clusters(gpu.arch, summed, grouped, stacked_rows(widths, grouped), hidden,
                                            gpu.sms - busy)


def summed_tiling(tokens: int, hidden: int, width: int, gpu: Gpu) -> GemmTiling:
    """grad_hidden's tiling: the GEMM core's rules, but for two bands measured better."""
    if gpu.arch == "sm_90a" and tokens <= 256:
        # 64 x 64 tiles: twice the CTAs on grad_hidden, and the idle ones still take the weight
        # gradients paired (paired_clusters). H200 (graph replay): 1x131 12.72 -> 11.86 us,
        # 2x128 12.55 -> 11.93; at 4x128 (80 CTAs, too few idle to pair) 14.12 -> 15.73, so not
        # there. Not a shorter K loop per CTA: clock stamps of one call put each k-tile at
        # ~150-165 ns with either tile (the gain is not explained yet).
        return GemmTiling(tile_m=64, tile_n=64)
    if gpu.arch == "sm_90a" and 3072 <= tokens < 6144 and hidden % 160 == 0:
        # Swept on the H200 (graph replay, Gemma-3-270m dims): at T = 4096 the rules'
        # 128x128c2x1p took 18.7 us and 128 x 160 tiles in 2 x 1 clusters 14.0 (four column
        # tiles of N = 640: 32 x 4 = 128 tiles, one wave); at T = 2048 and 8192 the rules' picks
        # were within 2% of the best.
        return GemmTiling(tile_m=128, tile_n=160, cluster_m=2)
    return default_tiling(tokens, hidden, width, gpu)


def grouped_tiling(tokens: int, hidden: int, width: int, gpu: Gpu) -> GemmTiling:
    """The weight gradients' tiling: the GEMM core's rules (64 x 128 tiles for these ~1M-element
    results), but from T = 3072 on sm_90a the same tiles in 4 x 1 clusters (hidden_states, the
    shared B, multicast to four CTAs: a quarter of its L2 reads; cuBLAS's pick for this product,
    in its transposed terms, is the same tile and cluster). H200, graph replay turn by turn,
    Gemma-3-270m dims:
    - one run, the product alone at T = 4096 / 8192: 2 x 1 clusters 16.2 / 29.6 us against
      18.0 / 33.3 for 128 x 64 and 21.0 / 32.6 for 128 x 128 in 2 x 1 clusters split-K;
    - another, the product alone: 4 x 1 clusters 15.1 / 31.1 against 16.5 / 30.9 for 2 x 1
      (cuBLAS 12.9 / 26.3); the whole op at 4096 / 8192 / 541 x 16: 45.18 / 81.74 / 87.71
      against 46.44 / 82.01 / 88.48."""
    if gpu.arch == "sm_90a" and tokens >= 3072:
        return GemmTiling(tile_m=64, cluster_m=4)
    return default_tiling(width, hidden, tokens, gpu)


# The audit's builds: Gemma-3-270m's dims at these T with the tilings (summed, grouped, paired?)
# an H200 (sm_90a) and a B200 (sm_100a) pick there (pairing; tests/test_dispatch.py holds this
# table to it). The audit compiles without a device, so the picks are written out.
AUDIT_PICKS = {
    131: {"sm_90a": ("64x64", "64x128", True), "sm_100a": ("64x128", "64x128", False)},
    1024: {"sm_90a": ("64x128", "64x128", False), "sm_100a": ("64x128", "64x128", False)},
    4096: {"sm_90a": ("128x160c2x1", "64x128c4x1", False), "sm_100a": ("128x128c2x1", "64x128", False)},
    8192: {"sm_90a": ("256x160", "64x128c4x1", False), "sm_100a": ("128x128c2x1", "64x128", False)},
}
AUDIT_WIDTHS = (1024, 256, 256)  # Gemma-3-270m: q, k, v output widths; hidden 640


def _audit_build(tokens: int):
    def build(arch, dump_dir):
        summed, grouped, paired = AUDIT_PICKS[tokens][arch]
        return _build(256, 4, 640, GemmTiling.from_spec(summed), GemmTiling.from_spec(grouped), arch, dump_dir,
                      paired)
    return build


AUDIT_BUILDS = {f"qkv_qknorm_backward[T={t}]": _audit_build(t) for t in AUDIT_PICKS}
# The norm rows: 16-byte cp.async loads into each warp's ring and 16-byte stores; the products:
# the GEMM core's own expectations (warpgroup or tcgen05 MMAs fed by TMA, TMA stores). No
# spills, no float atomics (fixed-order sums).
AUDIT_EXPECTS = {"sm_90a": {"require": ["LDGSTS", "STG.128", "HGMMA", "UTMALDG", "UTMASTG"],
                            "forbid": ["LOCAL", "ATOM/RED.FLOAT", "HGMMA.SERIAL"]},
                 "sm_100a": {"require": ["LDGSTS", "STG.128", "UTCMMA", "UTMALDG", "UTMASTG", "LDTM",
                                         "TMEM.WAIT.LD"],
                             "forbid": ["LOCAL", "ATOM/RED.FLOAT"]}}


def audit_expects(summed: GemmTiling, head_dim: int = 256) -> dict:
    """What a build's machine code must hold, with two known exceptions of spilled registers
    (LOCAL), where the norm prologue's per-lane state shares the kernel's registers:
    - sm_90a, 256 x 160 tiles (the summed product from T = 6144): ptxas spills three values (an
      address set up before the tile loop, 7 LDL/STL, none in the MMA loop) in the consumer
      warpgroups; without the prologue it did not. Kept because it measured fastest (H200,
      graph replay us, T = 8192 / 128x64 / 541x16 workloads): 256x160 85.7 / 87.0 / 92.1,
      against the best spill-free tiling, 128x128c2x1p, 88.7 / 88.3 / 92.3;
    - sm_100a at head_dim > 512 (an odd shape; Gemma's 256 holds none): four 16-byte vectors a
      lane of each row and the per-lane sums and scales (qk_norm_rows) in a kernel of 192
      threads at 255 registers; every summed tiling tried spills (64x128 4 LDL/STL, 128x64 12,
      128x128c2x1 82). Correct, slower by an amount no Blackwell GPU here can measure."""
    expects = dict(AUDIT_EXPECTS)
    if summed.tile_m == 256:
        expects["sm_90a"] = {**expects["sm_90a"], "forbid": ["ATOM/RED.FLOAT", "HGMMA.SERIAL"]}
    if head_dim > 512:
        expects["sm_100a"] = {**expects["sm_100a"], "forbid": ["ATOM/RED.FLOAT"]}
    return expects


AUDIT_EXPECTS_BY_BUILD = {"qkv_qknorm_backward[T=8192]": audit_expects(GemmTiling(tile_m=256, tile_n=160))}


class _Entry:
    """What one model's dims on one device need per call: the widest grid, the per-stream
    partial rows and barrier counters, and the per-stream dq/dk buffer (grown to the longest
    call)."""

    def __init__(self, head_dim: int, q_heads: int, device):
        self.device, self.head_dim, self.q_heads = device, head_dim, q_heads
        self.gpu = device_gpu(device)
        self.max_ctas = self.gpu.sms  # the widest grid
        # per stream, one lookup a call: the norm grid's partial rows, the grid barrier's
        # counters and the dq/dk buffer
        self.scratch = _Scratch(self.max_ctas, 2 * head_dim, device)
        # what the norm-weight gradients are made like (empty_like is the cheapest allocation)
        self.norm_grad_like = torch.empty(head_dim, dtype=torch.float32, device=device)
        self._clusters = {}  # cluster size -> clusters the device holds at once (the query synchronizes)

    def max_clusters(self, size: int) -> int:
        if size not in self._clusters:
            self._clusters[size] = runtime.max_clusters(self.device, size)
        return self._clusters[size]


class _Scratch(runtime.StreamWorkspace):
    """Per stream: the norm rows' partial rows (fp32 [ctas, 2d]), the grid barrier's count
    (int32 [BARRIER_WORDS], zero before the first call) and the dq/dk buffer (bf16, grown to the
    longest call). The three are made again together when it grows; dropping the old ones is
    safe, as the caching allocator hands their memory out again only after the work already
    queued on that stream."""

    def _new(self, dqk_elements: int):
        return (super()._new(), torch.zeros(BARRIER_WORDS, dtype=torch.int32, device=self.device),
                torch.empty(dqk_elements, dtype=torch.bfloat16, device=self.device))

    def _fits(self, buffer, dqk_elements: int) -> bool:
        return buffer[2].numel() >= dqk_elements


class _Plan:
    """What one (batch, seq, hidden) needs per call: the build for its tilings and the
    products' schedules."""

    def __init__(self, entry: _Entry, batch: int, seq: int, hidden: int):
        d, tokens = entry.head_dim, batch * seq
        widths = (entry.q_heads * d, d, d)
        self.entry, self.batch, self.seq, self.hidden = entry, batch, seq, hidden
        self.dqk_elements = tokens * sum(widths[:2])
        if tokens == 0:  # no launch: the call zeroes the outputs
            return
        summed, grouped, idle = pairing(tokens, hidden, widths, entry.gpu)

        def schedule(tiling, m, k, clusters=None):
            clusters = clusters or entry.max_clusters(tiling.cluster_m * tiling.cluster_n)
            return Call(None, clusters, tiling, m, hidden, k, entry.device, None, torch.bfloat16)

        self.summed = schedule(summed, tokens, stacked_k(widths, summed))
        # the summed product's grid, the norm rows' too: every cluster the device holds at once
        # (all resident: its prologue ends at a grid barrier)
        size = summed.cluster_m * summed.cluster_n
        self.grid = entry.max_clusters(size) * size
        self.grouped = schedule(grouped, stacked_rows(widths, grouped), tokens, idle)
        self.run = runtime.ffi_function(_build(d, entry.q_heads, hidden, summed, grouped, entry.gpu.arch,
                                               paired=idle is not None))


_entries: dict = {}  # (head_dim, q heads, device index) -> _Entry, shared by the plans of its shapes

OUTPUT_NAMES = ("grad_hidden_states", "grad_q_weight", "grad_k_weight", "grad_v_weight", "grad_q_norm_weight",
                "grad_k_norm_weight")


def _check_inputs(grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight, q_norm_weight,
                  k_norm_weight, q_rstd, k_rstd, q_normed, k_normed):
    """Shapes, dtypes, devices and the layouts read in place, named in the messages (of the
    tensors read: not query_transposed / key_transposed)."""
    check_tensor("hidden_states", hidden_states, dtypes=torch.bfloat16, ndim=3)
    batch, seq, hidden = hidden_states.shape
    check_tensor("grad_query", grad_query, dtypes=torch.bfloat16, ndim=4, contiguous=False)
    _, q_heads, _, head_dim = grad_query.shape
    check_tensor("grad_key", grad_key, dtypes=torch.bfloat16, ndim=4, contiguous=False)
    kv_heads = grad_key.shape[1]
    if hidden % VECTOR:
        raise ValueError(f"hidden_states: the hidden size must be a multiple of {VECTOR} (16-byte rows for TMA), "
                         f"got {hidden}")
    if head_dim % VECTOR or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"grad_query: head_dim must be a positive multiple of {VECTOR} up to {MAX_HEAD_DIM}, "
                         f"got {head_dim}")
    q_rows, kv_rows = (batch, q_heads, seq, head_dim), (batch, kv_heads, seq, head_dim)
    for name, t, shape in (("grad_query", grad_query, q_rows), ("q_normed", q_normed, q_rows),
                           ("grad_key", grad_key, kv_rows), ("k_normed", k_normed, kv_rows)):
        check_tensor(name, t, dtypes=torch.bfloat16, shape=shape, contiguous=False)
        if t.stride(3) != 1 or any(t.stride(i) % VECTOR for i in range(3)):
            raise ValueError(f"{name}: needs a contiguous last dimension and other strides that are multiples of "
                             f"{VECTOR}, got strides {t.stride()}")
    check_tensor("grad_value", grad_value, dtypes=torch.bfloat16, shape=kv_rows, contiguous=False)
    # an empty tensor's strides mean nothing (torch gives [2, 1, 0, d] the strides (d, d, d, 1))
    if kv_heads != 1 or grad_value.numel() and (
            grad_value.stride(3) != 1 or grad_value.stride(2) != head_dim
            or (batch > 1 and grad_value.stride(0) != seq * head_dim)):
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
                      k_norm_weight=k_norm_weight, q_rstd=q_rstd, k_rstd=k_rstd, q_normed=q_normed, k_normed=k_normed)


def _outputs(out, hidden_states, q_weight, k_weight, v_weight, head_dim, norm_grad_like=None):
    """The caller's six outputs checked, or new ones (the norm-weight gradients like
    `norm_grad_like`, an fp32 [head_dim] tensor on the device, where given)."""
    if out is None:
        # empty_like is the cheapest allocation on the H200 host (1.73-1.98 us a tensor against
        # 2.20-2.48 for torch.empty(shape, dtype=, device=))
        norm = (torch.empty_like(norm_grad_like) if norm_grad_like is not None
                else torch.empty(head_dim, dtype=torch.float32, device=hidden_states.device))
        return (torch.empty_like(hidden_states), torch.empty_like(q_weight), torch.empty_like(k_weight),
                torch.empty_like(v_weight), norm, torch.empty_like(norm))
    shapes = (tuple(hidden_states.shape), tuple(q_weight.shape), tuple(k_weight.shape), tuple(v_weight.shape),
              (head_dim,), (head_dim,))
    dtypes = (torch.bfloat16,) * 4 + (torch.float32,) * 2
    if not isinstance(out, (tuple, list)) or len(out) != 6:
        raise ValueError(f"out: a tuple of the six outputs {OUTPUT_NAMES}")
    for name, t, shape, dtype in zip(OUTPUT_NAMES, out, shapes, dtypes):
        check_tensor(f"out[{name}]", t, dtypes=dtype, shape=shape)
    check_same_device(hidden_states=hidden_states, **dict(zip(OUTPUT_NAMES, out)))
    return tuple(out)


def qkv_qknorm_backward(grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight,
                        q_norm_weight, k_norm_weight, query_transposed, key_transposed, q_rstd, k_rstd, q_normed,
                        k_normed, rms_norm_eps=1e-6, *, out=None):
    """The QKV projection with Q/K RMSNorm backward -> (grad_hidden_states, grad_q_weight,
    grad_k_weight, grad_v_weight, grad_q_norm_weight, grad_k_norm_weight), as semantics.md says
    (rms_norm_eps is already inside the given rstd). Per-head tensors [b, heads, s, d] are read
    in place through their strides (unit last stride, others multiples of 8); grad_value is read
    in place as the [T, d] operand, so one kv head (Gemma-3-270m's) with contiguous rows.
    query_transposed and key_transposed are not read and not checked (contract version 2 takes
    dq/dk from q_normed / k_normed); they may be None. out= takes the six outputs. The
    norm-weight gradients are bitwise repeatable (fixed-order sums); the weight gradients as the
    GEMM core's split-K is (fixed order). One or two launches, one host call."""
    inputs = (grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight, q_norm_weight,
              k_norm_weight, q_rstd, k_rstd, q_normed, k_normed)
    try:
        plan = _plans[_plan_key(*inputs)]
    except KEY_ERRORS:
        plan = _plans.first_call(*inputs)  # a new shape or device: full checks first
    errors.raise_pending(plan.entry.device.index)
    if not (type(out) is tuple and len(out) == 6):
        out = _outputs(out, hidden_states, q_weight, k_weight, v_weight, plan.entry.head_dim,
                       plan.entry.norm_grad_like)
    if plan.dqk_elements == 0:
        for t in out:
            t.zero_()
        return out
    # The C side checks shapes and fixed strides; the batch strides of the [b, s, *] tensors
    # read as [T, *] rows are free there, so they are checked here.
    if plan.batch > 1 and (hidden_states.stride(0) != plan.seq * plan.hidden
                           or out[0].stride(0) != plan.seq * plan.hidden
                           or grad_value.stride(0) != plan.seq * plan.entry.head_dim):
        _explain(inputs, out)
        raise ValueError("hidden_states, grad_value and out[grad_hidden_states] are read as [T, *] rows: their "
                         "batch stride must be seq rows")
    partials, arrivals, dqk = plan.entry.scratch.get(plan.dqk_elements)
    try:
        plan.run(grad_query, q_rstd, q_normed, q_norm_weight, grad_key, k_rstd, k_normed, k_norm_weight, grad_value,
                 hidden_states, q_weight, k_weight, v_weight, *out, dqk, partials,
                 *(plan.summed.fixed_args or (*plan.summed.workspace.get(), *plan.summed.schedule)),
                 *(plan.grouped.fixed_args or (*plan.grouped.workspace.get(), *plan.grouped.schedule)),
                 arrivals, plan.grid)
    except Exception:
        _explain(inputs, out)  # a rejected argument: say which one and why in our own words
        raise
    return out


def _plan_key(grad_query, grad_key, grad_value, hidden_states, *rest):
    """(hidden_states' shape, q heads, head_dim, device index)."""
    return hidden_states.shape, grad_query.shape[1], grad_query.shape[3], hidden_states.get_device()


def _new_plan(key, grad_query, grad_key, grad_value, hidden_states, *rest):
    """The build and schedules for a new (shape, device), on checked arguments; the entry of its
    (head_dim, q heads, device) is shared."""
    shape, q_heads, head_dim, device_index = key
    entry = _entries.get((head_dim, q_heads, device_index))
    if entry is None:
        entry = _entries[head_dim, q_heads, device_index] = _Entry(head_dim, q_heads, hidden_states.device)
    return _Plan(entry, *shape)


_plans = CallCache(_plan_key, _check_inputs, _new_plan)


def _explain(inputs, out):
    """For a call the fast path rejected: raise our named error where the checks find one."""
    _check_inputs(*inputs)
    _outputs(out, *inputs[3:7], inputs[0].shape[3])
