"""What dispatch builds: every kernel a GPU's first calls compile, for every op on every workload
of semantics.md (version 2) and a set of odd shapes, resolved by the ops' own dispatch code
(GemmCall.tiling_on, qkv_qknorm_backward.pairing) given the GPU's arch and SM count instead of
a device, and de-duplicated. tools/audit.py compiles each without a GPU and checks it against
its kernel's declarations and the arch's limits:

    python -m cutebwd.tools.audit --dispatch

The norm ops build one kernel per hidden size, dtype and path whatever the token count; where
their modules pick it from the device (the fused residual RMSNorm backward's one-launch
clusters, the embedding backward's index pass), the choices are listed here as the modules make
them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from cutlass import BFloat16, Float32, Int64

from ..kernels import (decoder_layer_backward, embedding_backward, embedding_row_kernel, gemm, id_radix,
                       padded_rows, qkv_qknorm_backward, rmsnorm_backward, row_rstd)
from ..layouts.gpus import Gpu
from .gpus import GPUS
from ..references import decoder_layer, embedding_rmsnorm, fused_residual_rmsnorm, qkv_qknorm
from ..references.inputs import model_dims
from ..references.workloads import WORKLOADS

# Odd shapes beside the workloads: (batch, seq, model dims overriding semantics.md's), those the
# GPU tests run (tests/test_*.py), sequences that are not a multiple of 8 and single tokens.
DECODER_SMALL = {"hidden": 256, "q_heads": 4, "kv_heads": 2, "head_dim": 32, "intermediate": 320}
DECODER_ODD = [(2, 37, DECODER_SMALL), (3, 64, {**DECODER_SMALL, "q_heads": 8, "kv_heads": 2, "head_dim": 64}),
               (1, 50, {**DECODER_SMALL, "kv_heads": 4}), (1, 1, DECODER_SMALL), (2, 13, DECODER_SMALL), (1, 1, None),
               (1, 13, None), (1, 991, None), (1, 2048, None)]
QKV_ODD = [(1, 1, None), (3, 37, {"head_dim": 128, "q_heads": 2, "hidden": 648}),
           (2, 100, {"head_dim": 64, "q_heads": 8, "hidden": 256}),
           (1, 300, {"head_dim": 512, "q_heads": 1, "hidden": 1024}),
           (1, 2048, {"head_dim": 1024, "q_heads": 2, "hidden": 1280}), (1, 3072, None), (1, 6144, None)]
FUSED_RESIDUAL_HIDDEN = (fused_residual_rmsnorm.DIMS["hidden"], 1000)  # the op builds per hidden size alone
EMBEDDING_ODD = [(1, 1, None), (3, 211, {"vocab": 1000, "hidden": 1000})]
# rms_rstd at the hidden sizes and dtypes of the four problems' normalized rows
RSTD_ROWS = ((Float32, 2560), (Float32, 4096), (BFloat16, 5120), (BFloat16, 256))


@dataclasses.dataclass(frozen=True)
class Build:
    """One compiled kernel as the audit takes it: `function(*args, arch=, dump_dir=, **options)`
    compiles it (equal fields, equal builds), `expects` is what its machine code must hold per
    arch (tools/audit.py)."""
    name: str
    function: Callable
    args: tuple = ()
    options: tuple = ()  # (keyword, value) pairs
    expects: dict = dataclasses.field(default=None, compare=False, hash=False)

    def compile(self, arch: str, dump_dir=None):
        return self.function(*self.args, arch=arch, dump_dir=dump_dir, **dict(self.options))


def _gemm(gpu: Gpu, call) -> Build:
    """The GEMM-core build `call` makes on `gpu` (GemmBuild.compile with the build as its first
    argument: equal builds, equal Builds)."""
    build = call.build(call.tiling_on(gpu))
    module = gemm.MAIN_LOOPS[gpu.arch]
    return Build(module.FAMILY + build.name, type(build).compile, (build,),
                 expects=module.AUDIT_EXPECTS)


def decoder_layer_builds(gpu: Gpu, batch: int, seq: int, dims=None):
    """The decoder layer: its products (gemm_calls), the two norms' row kernel and, at a
    sequence that is not a multiple of 8, the scores' padded copy
    (decoder_layer_backward._backward)."""
    hidden = model_dims(decoder_layer.DIMS, dims)["hidden"]
    yield from (_gemm(gpu, call) for call in decoder_layer_backward.gemm_calls(batch, seq, dims))
    yield Build(f"fused_residual_rmsnorm_backward[H={hidden},056 form]", rmsnorm_backward._build, (hidden, True),
                (("form", rmsnorm_backward.DECODER_FORM),), rmsnorm_backward.AUDIT_EXPECTS)
    if seq % decoder_layer_backward.TMA_STRIDE:
        yield Build("padded_rows[bf16]", padded_rows._build, expects=padded_rows.AUDIT_EXPECTS)


def qkv_qknorm_builds(gpu: Gpu, batch: int, seq: int, dims=None):
    """The QKV backward: one build a (model dims, tilings, paired) (qkv_qknorm_backward._Plan)."""
    d, heads, hidden = (model_dims(qkv_qknorm.DIMS, dims)[k] for k in ("head_dim", "q_heads", "hidden"))
    summed, grouped, idle = qkv_qknorm_backward.pairing(batch * seq, hidden, (heads * d, d, d), gpu)
    yield Build(f"qkv_qknorm_backward[d={d},{heads} heads,H={hidden},summed {summed.spec},grouped {grouped.spec}"
                f"{',paired' if idle is not None else ''}]", qkv_qknorm_backward._build,
                (d, heads, hidden, summed, grouped), (("paired", idle is not None),),
                qkv_qknorm_backward.audit_expects(summed, d))


def fused_residual_rmsnorm_builds(hidden: int):
    """The fused residual RMSNorm backward: the grid build, and the one-launch build of one or
    two 16-CTA clusters (as many as the device holds at once, up to two:
    rmsnorm_backward._Entry), normalized given (the benchmark's calls) or computed from x."""
    for normalized in (True, False):
        what = "normalized" if normalized else "normalized=None"
        yield Build(f"fused_residual_rmsnorm_backward[H={hidden},{what}]", rmsnorm_backward._build,
                    (hidden, normalized), expects=rmsnorm_backward.AUDIT_EXPECTS)
        for clusters in (1, 2):
            yield Build(f"fused_residual_rmsnorm_backward[H={hidden},{what},{clusters} cluster{'s' * (clusters > 1)}]",
                        rmsnorm_backward._build, (hidden, normalized), (("clusters", clusters),),
                        rmsnorm_backward.AUDIT_EXPECTS)


def embedding_rmsnorm_builds(batch: int, seq: int, dims=None):
    """The embedding backward as the benchmark calls it (int64 ids, bf16 norm_weight, a fresh
    table): ids sorted on chip up to SORT_ON_CHIP_MAX_TOKENS tokens, else the radix sort and the
    row kernel on sorted ids (embedding_backward.embedding_rmsnorm_backward's paths)."""
    dims = model_dims(embedding_rmsnorm.DIMS, dims)
    hidden, vocab, tokens = dims["hidden"], dims["vocab"], batch * seq
    expects = embedding_backward.AUDIT_EXPECTS
    if tokens <= embedding_backward.SORT_ON_CHIP_MAX_TOKENS and vocab <= embedding_backward.SORT_ON_CHIP_MAX_VOCAB:
        yield Build(f"embedding_rmsnorm_backward[H={hidden},norm_weight bf16,fresh,ids sorted on chip]",
                    embedding_row_kernel.build, (hidden, False, BFloat16), (("ids_dtype", Int64),), expects)
    elif tokens <= id_radix.MAX_TOKENS and vocab <= id_radix.MAX_VOCAB:
        yield Build("embedding_rmsnorm_backward ids radix sort", id_radix.build, (Int64,), (), id_radix.AUDIT_EXPECTS)
        yield Build(f"embedding_rmsnorm_backward[H={hidden},norm_weight bf16,fresh]",
                    embedding_row_kernel.build, (hidden, False, BFloat16), (), expects)
    else:
        raise ValueError(f"087 at {batch} x {seq}, vocabulary {vocab}: a path the audit does not list")


def requests(gpu: Gpu):
    """(op, case, Build) for every build every case's first call on `gpu` asks for."""
    def cases(op, odd):
        return [(batch, seq, None) for seq, batch in WORKLOADS[op]] + odd

    def named(batch, seq, dims):
        return f"{batch}x{seq}" + (f" {dims}" if dims else "")

    for batch, seq, dims in cases("decoder_layer_backward", DECODER_ODD):
        for build in decoder_layer_builds(gpu, batch, seq, dims):
            yield "decoder_layer_backward", named(batch, seq, dims), build
    for batch, seq, dims in cases("qkv_qknorm_backward", QKV_ODD):
        for build in qkv_qknorm_builds(gpu, batch, seq, dims):
            yield "qkv_qknorm_backward", named(batch, seq, dims), build
    for hidden in FUSED_RESIDUAL_HIDDEN:  # the same builds at every token count
        for build in fused_residual_rmsnorm_builds(hidden):
            yield "fused_residual_rmsnorm_backward", f"H={hidden}", build
    for batch, seq, dims in cases("embedding_rmsnorm_backward", EMBEDDING_ODD):
        for build in embedding_rmsnorm_builds(batch, seq, dims):
            yield "embedding_rmsnorm_backward", named(batch, seq, dims), build
    for dtype, hidden in RSTD_ROWS:
        yield "rms_rstd", f"{dtype.__name__} H={hidden}", Build(
            f"row_rstd[{dtype.__name__},H={hidden}]", row_rstd._build, (dtype, hidden), expects=row_rstd.AUDIT_EXPECTS)


def distinct_builds(gpu: Gpu) -> dict:
    """{Build: [(op, case), ...]}: each distinct build once, with every case that asks for it."""
    found: dict = {}
    for op, case, build in requests(gpu):
        found.setdefault(build, []).append((op, case))
    return found


def gpus(names=None) -> list[Gpu]:
    return [GPUS[name] for name in (names or GPUS)]
