"""The host side of the GEMM core: argument checks, the tiling (GemmCall.tiling_on:
layouts.gemm's rules on the GPU's arch and SM count, which the audit calls with no GPU), the
per-shape call cache, the stream-K plan and its per-stream workspace, and dispatch to the
arch's main loop (sm90.py: warpgroup MMAs into registers; sm100.py: tcgen05 MMAs into tensor
memory), imported here as ordinary modules: they import only core.py and epilogue.py.
"""
from __future__ import annotations

import dataclasses

from ...layouts.gemm import MIN_K_TILES, GemmTiling, default_tiling, even_clusters, stream_k_plan, tuned_tiling
from ...layouts.gpus import Gpu
from .. import runtime
from ..calls import KEY_ERRORS, CallCache
from . import sm90, sm100
from .core import NO_EPILOGUE_TENSORS
from .epilogue import ADD, KINDS, STORE, TWO_OUTPUTS, Epilogue, check_epilogue_tensors

# The per-arch main loops: Hopper's warpgroup MMAs, Blackwell's tcgen05 (B200 and B300 alike).
MAIN_LOOPS = {"sm_90a": sm90, "sm_100a": sm100, "sm_103a": sm100}


@dataclasses.dataclass(frozen=True)
class GemmBuild:
    """One compiled kernel of the GEMM core: what its compile key names (compile_gemm). The
    tiling's split_k is the host's schedule, not the kernel's, so a build never carries it."""
    tiling: GemmTiling
    a_k_major: bool
    b_k_major: bool
    c_dtype: str = "bfloat16"
    epilogue: Epilogue = STORE
    products: int = 1  # 2 or 3: a group sharing B (stack "m") or a sum into one C (stack "k")
    stack: str = "m"
    batched: int = 0  # 0: one product; 1: a batch; G > 1: a batch of sums over G products

    def compile(self, arch: str, dump_dir=None):
        return MAIN_LOOPS[arch].build(self.tiling, self.a_k_major, self.b_k_major, self.c_dtype, arch, dump_dir, self.epilogue,
                            self.products, self.stack, self.batched)

    @property
    def name(self) -> str:
        """As the audit names it, after its family: the tiling's spec, then what else differs."""
        t, epilogue, batched = self.tiling, self.epilogue, self.batched
        return (f"[{t.spec},A {'K' if self.a_k_major else 'M'}-major,B {'K' if self.b_k_major else 'N'}-major,"
                f"C {self.c_dtype}" + ("" if epilogue is STORE else f",epilogue {epilogue.name}")
                + ("" if self.products == 1 else f",{self.products} products "
                   f"{'summed' if self.stack == 'k' else 'stacked'}")
                + ("]" if not batched else ",batched]" if batched == 1 else f",batch sums of {batched}]"))


def audit_builds(main_loop):
    """The audit's named builds of an arch's main loop module: its AUDIT_CASES as GemmBuilds,
    named after its FAMILY."""
    builds = (GemmBuild(*case) for case in main_loop.AUDIT_CASES)
    return {main_loop.FAMILY + build.name: build.compile for build in builds}


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """One call of the GEMM core as dispatch sees it: what picks its tiling and its build, and
    nothing else of the tensors. A wrapper makes it from the tensors on a shape's first call;
    an op's listing of its products (decoder_layer_backward.gemm_calls) makes it from shapes,
    so the audit compiles what a GPU's first call builds."""
    m: int  # C's rows (a group sharing B: its products' rows together)
    n: int
    k: int  # what the tiling rules see: a sum's K, its terms' together (a batch of sums: in k-tiles)
    a_k_major: bool
    b_k_major: bool
    c_dtype: str = "bfloat16"
    epilogue: Epilogue = STORE
    group_n: int | None = None  # row sums' or tables' column group: the tile width
    batches: int = 1  # a batch's outputs
    batched: int = 0  # as GemmBuild's
    products: int = 1
    stack: str = "m"
    tiling: GemmTiling | None = None  # asked for by the caller

    def tiling_on(self, gpu: Gpu) -> GemmTiling:
        """The tiling dispatch picks on `gpu`: the one asked for; else for a single plain product
        the tuner's pick for its bucket, for a group sharing B the stacked product's (no cluster
        fitting: its stacked rows are whole cluster tiles per product), else the rules'."""
        m, n, k, arch = self.m, self.n, self.k, gpu.arch
        if self.products > 1 and self.stack == "m":
            return self.tiling or tuned_tiling(m, n, k, self.a_k_major, self.b_k_major, arch) \
                or default_tiling(m, n, k, gpu)
        single = self.products == 1 and not self.batched and self.epilogue is STORE
        tuned = tuned_tiling(m, n, k, self.a_k_major, self.b_k_major, arch) if single and not self.tiling else None
        return choose_tiling(self.tiling, m, n, k, gpu, self.epilogue, self.group_n, batches=self.batches,
                             tuned=tuned, summed=max(1, self.batched))

    def build(self, tiling: GemmTiling) -> GemmBuild:
        return GemmBuild(dataclasses.replace(tiling, split_k=False), self.a_k_major, self.b_k_major, self.c_dtype,
                         self.epilogue, self.products, self.stack, self.batched)


class _StreamKWorkspace(runtime.StreamWorkspace):
    """Per CUDA stream: fp32 partial tiles [ctas, tile elements] and int32 ready flags [ctas].
    The flags start at zero and each finisher sets the ones it consumed back to zero, so a
    pair serves call after call on its stream. Under CUDA-graph capture a pair comes from the
    graph's pool (runtime.PerStream: one a capture sequence and stream, its zero fill captured
    once)."""

    def _new(self):
        import torch

        return super()._new(), torch.zeros(self.shape[0], dtype=torch.int32, device=self.device)


def k_major(t, name):
    """True if the [rows, K] view `t` is K-major (K contiguous), False if rows are contiguous."""
    if t.stride(1) == 1:
        return True
    if t.stride(0) == 1:
        return False
    raise ValueError(f"{name}: one of the two dimensions must be contiguous, got strides {t.stride()}")


def check_operands(a, b, out, a_name="a", out_name="out", b_name="b"):
    """The full argument check, with messages that name the argument: run on a shape's first
    call and to explain a call the compiled function's own (C) checks reject."""
    import torch

    from ..checks import check_same_device, check_tensor, check_tma_rows

    check_tensor(a_name, a, dtypes=torch.bfloat16, ndim=2, contiguous=False)
    check_tensor(b_name, b, dtypes=torch.bfloat16, ndim=2, contiguous=False)
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"{a_name} is [{m}, {k}] and {b_name} is [{n}, {k_b}]: the K extents differ")
    for name, t in ((a_name, a), (b_name, b)):
        k_contiguous = k_major(t, name)
        if t.numel() and k_contiguous and t.stride(0) % 8 or not k_contiguous and t.stride(1) % 8:
            raise ValueError(f"{name}: the non-contiguous stride must be a multiple of 8 elements (16 bytes) "
                             f"for TMA, got strides {t.stride()}")
    if out is not None:
        check_tensor(out_name, out, dtypes=(torch.bfloat16, torch.float32), shape=(m, n), contiguous=False)
        check_tma_rows(out_name, out)
    check_same_device(**{a_name: a, b_name: b, out_name: out})


# (tiling, a K-major?, b K-major?, C dtype, device, epilogue, products, stack, batched)
#     -> (TVM-FFI function, max clusters); see compiled_kernel
_compiled: dict = {}


MIN_ITERATIONS = 4  # k-iterations a stream-K share must have to be worth its partial-tile traffic


class Call:
    """What one shape needs per call, resolved on its first call."""

    def __init__(self, run, max_clusters: int, tiling: GemmTiling, m: int, n: int, k: int, device, stream_k,
                 out_dtype, batches: int = 1):
        # The schedule deals out cluster tiles to clusters (one CTA per SM, no more clusters
        # than can be resident at once: a cluster that waits for a free GPC would run its whole
        # share after everyone else), at most one cluster per tile unless tiling.split_k; a
        # batch of products lays its tiles end to end.
        size = tiling.cluster_m * tiling.cluster_n
        tiles = tiling.cluster_tiles(m, n) * batches
        clusters = max(1, max_clusters if tiling.split_k else min(max_clusters, tiles))  # an empty C never launches
        self.run, self.ctas = run, clusters * size
        if stream_k is False:
            self.dp_tiles, self.per = tiles, 0
        else:  # None: the plan's own thresholds; True: wherever the tiles leave a ragged wave
            self.dp_tiles, self.per = stream_k_plan(tiles, -(-k // tiling.tile_k), clusters,
                                                    min_iterations=1 if stream_k else MIN_ITERATIONS,
                                                    min_k_tiles=1 if stream_k else MIN_K_TILES)
        elements = tiling.tile_m * tiling.tile_n
        self.workspace = _StreamKWorkspace(self.ctas if self.per else 1, elements, device)
        self.schedule = (self.ctas, self.dp_tiles, self.per)
        # Without stream-K units the kernel never touches the workspace: one stand-in pair
        # serves every stream and graph, and calls skip the per-stream lookup.
        self.fixed_args = None if self.per else (*self.workspace._new(), *self.schedule)
        self.out_dtype, self.device = out_dtype, device


def device_gpu(device) -> Gpu:
    """The device's arch and SM count, if the GEMM core has a build for its arch."""
    gpu = runtime.device_gpu(device.index)
    if gpu.arch not in MAIN_LOOPS:
        raise NotImplementedError(f"the GEMM core has no build for {gpu.arch} ({', '.join(MAIN_LOOPS)} only)")
    return gpu


def compiled_kernel(arch: str, device, build: GemmBuild):
    """(TVM-FFI function, clusters the GPU holds at once) of `build`, compiled once per device
    (the whole epilogue is in it, softmax_bwd's alpha included)."""
    key = (build, device.index)
    if key not in _compiled:
        tiling = build.tiling
        _compiled[key] = (runtime.ffi_function(build.compile(arch)),
                          runtime.max_clusters(device, tiling.cluster_m * tiling.cluster_n))
    return _compiled[key]


def _call_key(a, b, out, tiling, c_dtype, stream_k, epilogue, inputs, out2, rows, alpha):
    """(M, N, K, a K-major?, b K-major?, C dtype, device, tiling asked, stream_k asked, epilogue)."""
    (m, k), n = a.shape, b.shape[0]
    return (m, n, k, a.stride(1) == 1, b.stride(1) == 1, c_dtype, a.get_device(), tiling, stream_k,
            epilogue_key(epilogue, rows, alpha, inputs))


def _check_args(a, b, out, tiling, c_dtype, stream_k, epilogue, inputs, out2, rows, alpha):
    check_call(a, b, out, c_dtype, epilogue_kind(epilogue, alpha), inputs, out2, rows)


def _new_call(key, a, b, out, tiling, c_dtype, stream_k, epilogue, inputs, out2, rows, alpha):
    """A shape's first call, on checked arguments: the tiling for it, the compiled kernel (once
    per tiling)."""
    import torch

    m, n, k, a_k_major, b_k_major = key[:5]
    kind = epilogue_kind(epilogue, alpha)
    gpu = device_gpu(a.device)
    group_n = n // rows.shape[1] if kind.row_sums else inputs[0].shape[1] if kind.tables else None
    product = GemmCall(m, n, k, a_k_major, b_k_major, c_dtype, kind, group_n, tiling=tiling)
    chosen = product.tiling_on(gpu)
    return Call(*compiled_kernel(gpu.arch, a.device, product.build(chosen)), chosen, m, n, k, a.device, stream_k,
                getattr(torch, c_dtype))


def choose_tiling(tiling, m: int, n: int, k: int, gpu: Gpu, epilogue: Epilogue, group_n,
                  batches: int = 1, tuned: GemmTiling | None = None, summed: int = 1) -> GemmTiling:
    """The tiling asked for, as it is; else the tuner's pick or the default one on `gpu` (for a
    batch of `batches` products), its cluster fitted to M's tile count
    (layouts.gemm.even_clusters). An epilogue that works per column group (row sums, tables:
    `group_n` columns) needs tiles exactly one group wide."""
    chosen = tiling or even_clusters(tuned or default_tiling(m, n, k, gpu, fused=len(epilogue.inputs),
                                                             group_n=group_n, batches=batches, summed=summed,
                                                             side_tensors=epilogue.side_tensors),
                                     m, n, gpu.arch)
    if group_n and chosen.tile_n != group_n:
        raise ValueError(f"tiling {chosen.spec}: the {epilogue.name!r} epilogue works per tile, so tile_n must be "
                         f"the column group (row sums: N / rows.shape[1]; tables: their width) = {group_n}")
    return chosen


ADD_NEEDS_OUT = "out: the 'add' epilogue adds into it, so it must be given"


def check_call(a, b, out, c_dtype, epilogue, inputs, out2, rows):
    """check_operands, and the epilogue's own tensors (`add` reads `out`): on a shape's first call and
    to explain a call the compiled function rejects."""
    check_operands(a, b, out)
    if epilogue is not STORE:
        check_epilogue_tensors(epilogue, (out,) if epilogue is ADD else inputs, out2, a.shape[0], b.shape[0],
                               a.device, rows)
        if c_dtype != "bfloat16":
            raise ValueError(f"out: the {epilogue.name!r} epilogue writes bf16, got {c_dtype}")


# -> Call, by _call_key
_calls = CallCache(_call_key, _check_args, _new_call)


def epilogue_key(epilogue: str, rows, alpha, inputs):
    """The epilogue's part of a shape's key: row sums are per tile column and tables one tile
    wide, so their column groups pick the tile width; softmax_bwd's alpha is built into its
    kernel."""
    if epilogue == "row_dot":
        return epilogue, getattr(rows, "shape", (0, 0))[1:]
    if epilogue == "rope_inverse":
        return epilogue, getattr(inputs[0] if inputs else None, "shape", (0, 0))[1:]
    return (epilogue, alpha) if epilogue == "softmax_bwd" else epilogue


def epilogue_kind(epilogue: str, alpha):
    kind = KINDS.get(epilogue)
    if kind is None:
        raise ValueError(f"epilogue: one of {sorted(KINDS)}, got {epilogue!r}")
    if epilogue == "softmax_bwd":
        return dataclasses.replace(kind, alpha=float(alpha))
    if alpha != 1.0:
        raise ValueError(f"alpha: only the 'softmax_bwd' epilogue scales, got alpha={alpha} for {epilogue!r}")
    return kind


def matmul_nt(a, b, *, out=None, out_dtype=None, tiling: GemmTiling | None = None, stream_k: bool | None = None,
              epilogue: str = "store", inputs=(), out2=None, rows=None, alpha: float = 1.0):
    """C[M, N] = A[M, K] . B[N, K]^T from bf16 operands with fp32 accumulation, and what a fused
    epilogue makes of it.

    a, b: bf16 CUDA tensors, read in place: either dimension may be the contiguous one, the
    other's stride a multiple of 8 elements, bases 16-byte aligned. out: bf16 or fp32 [M, N]
    with unit column stride (or out_dtype, bf16 by default, for a new one). The dX product of a
    linear layer is matmul_nt(dY, W.t()), the dW product matmul_nt(dY.t(), X.t()). M, N, K
    need not be tile multiples (TMA bounds the loads and stores). tiling: the tile shape
    (by default the tuner's pick for the shape bucket, layouts/tuned/<arch>.json, else
    layouts.gemm.default_tiling). stream_k: None lets layouts.gemm.stream_k_plan
    decide whether the ragged last wave is cut into k-iterations (never below MIN_K_TILES),
    True forces it wherever the tiles do not fill whole waves, False never. The result is
    bitwise repeatable either way.

    epilogue (epilogue.py, bf16 out only): "store" (out = A . B^T); "add" (out += A . B^T,
    out required); "dswiglu" (inputs=(gate, up, silu_up), bf16 [M, N]: out = grad_gate, out2 = grad_up,
    allocated when not given; returns (out, out2)); "dgeglu" (inputs=(gate, up), the same outputs
    for h = gelu_tanh(gate) * up); "row_dot" (inputs=(x,), bf16 [M, N]: out =
    A . B^T, and `rows`, fp32 [M, G], required: rows[i, j] = sum over the j-th group of N / G
    columns of the product as stored (bf16) times x, e.g. per attention head; the tiles are N / G wide;
    returns (out, rows)); "softmax_bwd" (inputs=(p,), bf16 [M, N], and `rows`, fp32 [M],
    required: out = p * (A . B^T - rows[:, None]) * alpha; a build per alpha); "rope_inverse"
    (inputs=(cos, sin), bf16 [M, d] RoPE tables with equal halves: out = the inverse rotation of
    A . B^T in every d-column head, out[:, j] = acc[:, j] cos[:, j] - rotate_half(acc)[:, j]
    sin[:, j]; the tiles are d wide).

    Host cost after a shape's first call: one dict lookup and one TVM-FFI call (plus the
    allocation without out=); the C entry point checks dtypes, shapes, strides and alignment.
    """
    import torch

    c_dtype = "float32" if (out is not None and out.dtype == torch.float32) or out_dtype == torch.float32 \
        else "bfloat16"
    if epilogue == "add" and out is None:  # before the lookup: a cached shape must refuse it too
        raise ValueError(ADD_NEEDS_OUT)
    call_args = (a, b, out, tiling, c_dtype, stream_k, epilogue, inputs, out2, rows, alpha)
    try:
        call = _calls[_call_key(*call_args)]
    except KEY_ERRORS:
        call = _calls.first_call(*call_args)
    m, n = a.shape[0], b.shape[0]
    if epilogue in TWO_OUTPUTS and out2 is None:
        out2 = torch.empty((m, n), dtype=torch.bfloat16, device=call.device)
    if out is None:
        out = torch.empty((m, n), dtype=call.out_dtype, device=call.device)
    results = (out, out2) if epilogue in TWO_OUTPUTS else (out, rows) if epilogue == "row_dot" else out
    if m and n:
        run_call(call, a, b, out, epilogue, inputs, out2, rows, alpha,
                 lambda: check_call(a, b, out, c_dtype, epilogue_kind(epilogue, alpha), inputs, out2, rows))
    return results


def run_call(call, a, b, out, epilogue: str, inputs, out2, rows, alpha, explain):
    """A resolved call's launch, or at K = 0 (a's last extent) the epilogue of a zero
    accumulator without one; when the C-side checks reject an argument, `explain()` says which
    and why in our words before the error goes on."""
    if a.shape[-1] == 0:
        _empty_k(epilogue, out, out2, inputs, rows, alpha)
        return
    try:
        call.run(a, b, out, *(call.fixed_args or (*call.workspace.get(), *call.schedule)),
                 *epilogue_arguments(epilogue, out, inputs, out2, rows))
    except Exception:
        explain()
        raise


def epilogue_arguments(epilogue: str, out, inputs, out2, rows):
    """The kernel's (in0, in1, in2, out1) for an epilogue (see fake_arguments): `add` reads C,
    tables ride as inputs, and a per-row tensor takes the second output's place."""
    if epilogue == "store":
        return NO_EPILOGUE_TENSORS
    if epilogue == "add":
        return out, None, None, None
    if epilogue == "dswiglu":
        return *inputs, out2
    if epilogue == "dgeglu":
        return *inputs, None, out2
    if epilogue == "rope_inverse":
        return *inputs, None, None
    return *inputs, None, None, rows  # row_dot, softmax_bwd: one input and the per-row tensor


def _empty_k(epilogue, out, out2, inputs, rows, alpha):
    """K = 0: the epilogue of a zero accumulator, with no kernel launched (softmax_bwd's
    p * (0 - rows) * alpha by PyTorch ops; batched tensors too)."""
    if epilogue == "softmax_bwd":
        out.copy_(inputs[0].float() * -rows.unsqueeze(-1) * alpha)
    elif epilogue != "add":  # "add": out += 0 (rope_inverse: a rotation of zeros)
        out.zero_()
    for other in (out2, rows if epilogue == "row_dot" else None):
        if other is not None:
            other.zero_()