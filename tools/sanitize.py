"""Every kernel once on small inputs under NVIDIA compute-sanitizer: memcheck (out-of-bounds,
misaligned and leaked accesses) and racecheck (shared-memory hazards), one process per tool.
Each case also checks its outputs against the reference (tools.parity), so a run that
sanitizes clean but computes wrong numbers still fails.

    python -m cutebwd.tools.sanitize [--tools memcheck,racecheck] [--only SUBSTRING]

Exit status 1 when a tool reports an error or a case fails. Needs a GPU and compute-sanitizer
on PATH (or under CUDA_HOME/bin).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import torch

from cutebwd.tools import tool_parser
from cutebwd.tools.timing import have_gpu, progress

TOOLS = ("memcheck", "racecheck")
# The products' checks: the benchmark's rule (rtol 0.05) against an fp32 product, with a fixed atol.
GEMM_ATOL = 1e-2


def _gemm_case(m, n, k, *, a_k_major=True, stream_k=None, fp32_c=False, epilogue="store", **tiling):
    def run():
        from cutebwd.kernels.gemm import matmul_nt
        from cutebwd.layouts.gemm import GemmTiling
        from cutebwd.tools.parity import assert_parity

        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16() if a_k_major else \
            torch.randn(k, m, device="cuda", generator=g).bfloat16().t()
        b = torch.randn(k, n, device="cuda", generator=g).bfloat16().t()
        c_dtype = torch.float32 if fp32_c else torch.bfloat16
        picked = GemmTiling(**tiling) if tiling else None
        product = a.float() @ b.float().t()
        if epilogue == "add":
            c = torch.randn(m, n, device="cuda", generator=g).bfloat16()
            want = c.float() + product
            assert_parity(["c"], [matmul_nt(a, b, out=c, epilogue="add", tiling=picked, stream_k=stream_k)], [want],
                          GEMM_ATOL)
        elif epilogue == "dswiglu":
            gate, up, silu_up = (torch.randn(m, n, device="cuda", generator=g).bfloat16() for _ in range(3))
            sig = torch.sigmoid(up.float())
            want = [product * silu_up.float(), product * gate.float() * sig * (1 + up.float() * (1 - sig))]
            got = matmul_nt(a, b, epilogue="dswiglu", inputs=(gate, up, silu_up), tiling=picked, stream_k=stream_k)
            assert_parity(["grad_gate", "grad_up"], list(got), want, GEMM_ATOL)
        elif epilogue == "row_dot":  # n / 160 heads of 160 columns
            x = torch.randn(m, n, device="cuda", generator=g).bfloat16()
            sums = torch.empty(m, n // 160, device="cuda")
            got = matmul_nt(a, b, rows=sums, epilogue="row_dot", inputs=(x,), tiling=picked, stream_k=stream_k)
            stored = got[0].float()  # row_dot sums C as stored
            assert_parity(["c", "row_sums"], list(got), [product, (stored * x.float()).view(m, -1, 160).sum(-1)],
                          GEMM_ATOL)
        elif epilogue == "rope_inverse":  # n / 160 heads of 160 columns
            angles = torch.rand(m, 80, device="cuda", generator=g).repeat(1, 2) * 6.3
            cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
            heads = product.view(m, -1, 160)
            rotated = torch.cat([-heads[..., 80:], heads[..., :80]], -1)
            want = (heads * cos.float()[:, None] - rotated * sin.float()[:, None]).view(m, n)
            got = matmul_nt(a, b, epilogue="rope_inverse", inputs=(cos, sin), tiling=picked, stream_k=stream_k)
            assert_parity(["c"], [got], [want], GEMM_ATOL)
        elif epilogue == "softmax_bwd":
            p = torch.rand(m, n, device="cuda", generator=g).bfloat16()
            d = torch.randn(m, device="cuda", generator=g)
            got = matmul_nt(a, b, epilogue="softmax_bwd", inputs=(p,), rows=d, alpha=0.25, tiling=picked,
                            stream_k=stream_k)
            assert_parity(["c"], [got], [p.float() * (product - d[:, None]) * 0.25], GEMM_ATOL)
        else:
            out = matmul_nt(a, b, out_dtype=c_dtype, tiling=picked, stream_k=stream_k)
            assert_parity(["c"], [out], [product], GEMM_ATOL)
    return run


def _grouped_case(ms, n, k, **options):
    def run():
        from cutebwd.kernels.gemm import matmul_nt_grouped
        from cutebwd.tools.parity import assert_parity

        g = torch.Generator(device="cuda").manual_seed(sum(ms) + n + k)
        a_list = [torch.randn(k, m, device="cuda", generator=g).bfloat16().t() for m in ms]  # dY_i^T views
        b = torch.randn(k, n, device="cuda", generator=g).bfloat16().t()
        outs = matmul_nt_grouped(a_list, b, **options)
        assert_parity([f"c{i}" for i in range(len(ms))], outs, [a.float() @ b.float().t() for a in a_list],
                      GEMM_ATOL)
    return run


def _summed_case(m, n, ks, **options):
    def run():
        from cutebwd.kernels.gemm import matmul_nt_summed
        from cutebwd.tools.parity import assert_parity

        g = torch.Generator(device="cuda").manual_seed(m + n + sum(ks))
        pairs = [(torch.randn(m, k, device="cuda", generator=g).bfloat16(),  # dY_i, and W_i^T views
                  torch.randn(k, n, device="cuda", generator=g).bfloat16().t()) for k in ks]
        out = matmul_nt_summed(pairs, **options)
        assert_parity(["c"], [out], [sum(a.float() @ b.float().t() for a, b in pairs)], GEMM_ATOL)
    return run


def _batched_case(b, heads, s, d, **options):
    """The decoder layer's attention scores and softmax backward per (batch, head), through the
    heads' strides."""
    def run():
        from cutebwd.kernels.gemm import matmul_nt_batched
        from cutebwd.tools.parity import assert_parity

        g = torch.Generator(device="cuda").manual_seed(b + heads + s)
        g_ao, v = (torch.randn(b, s, heads * d, device="cuda", generator=g).bfloat16().view(b, s, heads, d)
                   .transpose(1, 2) for _ in range(2))
        p = torch.rand(b, heads, s, s, device="cuda", generator=g).bfloat16()
        rows = torch.randn(b, heads, s, device="cuda", generator=g)
        got = matmul_nt_batched(g_ao, v, epilogue="softmax_bwd", inputs=(p,), rows=rows, alpha=0.25, **options)
        want = p.float() * (g_ao.float() @ v.float().transpose(-1, -2) - rows[..., None]) * 0.25
        assert_parity(["g_s"], [got], [want], GEMM_ATOL)
    return run


def _problem_case(problem, batch, seq, *, without_normalized=False, **options):
    """check_problem of the op named like the problem; `without_normalized`: the fused residual
    RMSNorm backward with normalized=None."""
    def run():
        import cutebwd
        from cutebwd.references import PROBLEMS
        from cutebwd.tools.parity import check_problem

        op = kernel = getattr(cutebwd, problem)
        if without_normalized:
            kernel = lambda grad_output, x, normalized, rstd, weight, out: op(grad_output, x, None, rstd, weight,
                                                                             out=out)
        check_problem(PROBLEMS[problem], kernel, batch, seq, **options)
    return run


def _accumulate_case(batch, seq, vocab, hidden):
    """The embedding backward adding into an existing table (the ring prefetches the table rows
    segments end in)."""
    def run():
        from cutebwd import embedding_rmsnorm_backward
        from cutebwd.references import PROBLEMS
        from cutebwd.tools.parity import assert_parity

        problem = PROBLEMS["embedding_rmsnorm_backward"]
        inputs = problem.make_inputs(batch, seq, device="cuda", seed=7, dims={"vocab": vocab, "hidden": hidden})
        table = torch.randn(vocab, hidden, device="cuda").bfloat16()
        want = problem.reference(*inputs, vocab_size=vocab, accumulate_into=table)
        exact = problem.reference(*inputs, vocab_size=vocab, accumulate_into=table, exact=True)
        out = (table.clone(), torch.full_like(want[1], float("nan")))
        embedding_rmsnorm_backward(*inputs, vocab_size=vocab, out=out, accumulate=True)
        assert_parity(problem.output_names, out, want, problem.atol(seq, batch), exact)
    return run


def _bad_ids_case(batch, seq, vocab, hidden):
    """The embedding backward with an id outside the vocabulary: a caller's table (fresh and
    accumulated) and the call's own, the error read back from the device's record."""
    def run():
        import cutebwd
        from cutebwd.references import PROBLEMS

        go, ids, x, rstd, w = PROBLEMS["embedding_rmsnorm_backward"].make_inputs(
            batch, seq, device="cuda", seed=11, dims={"vocab": vocab, "hidden": hidden})
        ids[-1, -1] = vocab
        out = (torch.ones(vocab, hidden, dtype=torch.bfloat16, device="cuda"), w.clone())
        for options in ({"out": out}, {"out": out, "accumulate": True}, {}):
            cutebwd.embedding_rmsnorm_backward(go, ids, x, rstd, w, vocab_size=vocab, **options)
            try:
                cutebwd.check_errors()
            except ValueError:
                pass
            else:
                raise AssertionError("an out-of-range id went unreported")
        assert bool((out[0] == 1).all()) and torch.equal(out[1], w)
    return run


# Small enough to finish under racecheck in seconds, large enough to take every code path:
# ragged tiles, clusters, pingpong, stream-K hand-over, 256-row tiles, fp32 C, fused epilogues; the
# fused residual RMSNorm backward with and without `normalized` (None: a second case); the
# embedding backward with duplicated ids and int32 ids.
CASES = {
    "gemm default": _gemm_case(1000, 776, 1000),
    "gemm M <= 128: 64x128, cluster 2x1": _gemm_case(100, 776, 1000),  # default_tiling's short-M rule
    "gemm M-major A, cluster 2x1": _gemm_case(520, 264, 200, a_k_major=False, tile_m=128, tile_n=128, cluster_m=2),
    "gemm pingpong, cluster 2x1, stream-K": _gemm_case(1000, 776, 1000, stream_k=True, tile_m=128, tile_n=128,
                                                       cluster_m=2, pingpong=True),
    "gemm 256x160": _gemm_case(600, 400, 320, tile_m=256, tile_n=160),
    "gemm fp32 C, stream-K": _gemm_case(300, 200, 1000, stream_k=True, fp32_c=True),
    # fused epilogues: TMA-loaded input slots reused for the outputs (two tiles per team at least)
    "gemm epilogue dswiglu, pingpong (its default), stream-K": _gemm_case(1000, 776, 1000, stream_k=True,
                                                                          epilogue="dswiglu"),
    "gemm epilogue add, 128x256 cluster 2x1": _gemm_case(600, 776, 320, epilogue="add", tile_m=128, tile_n=256,
                                                         cluster_m=2),
    "gemm epilogue row_dot, 160-column heads, stream-K": _gemm_case(1000, 800, 1000, stream_k=True,
                                                                    epilogue="row_dot"),
    # a 1 x 2 cluster over 5 tile rows (what even_clusters turns 2 x 1 into) and an odd count of
    # tile columns: the second CTA of the last cluster column has no tile (TMA bounds; row sums
    # guard the column)
    "gemm cluster 1x2, odd tile columns": _gemm_case(600, 776, 1000, tile_m=128, tile_n=128, cluster_n=2),
    "gemm epilogue row_dot, cluster 1x2, five heads": _gemm_case(600, 800, 1000, epilogue="row_dot", tile_m=128,
                                                                 tile_n=160, cluster_n=2),
    "gemm epilogue softmax_bwd, pingpong (its default), stream-K": _gemm_case(1000, 776, 1000, stream_k=True,
                                                                              epilogue="softmax_bwd"),
    "gemm epilogue rope_inverse, 160-column heads, stream-K": _gemm_case(1000, 800, 1000, stream_k=True,
                                                                         epilogue="rope_inverse"),
    "gemm batched softmax_bwd, 2 x 3 heads, stream-K": _batched_case(2, 3, 200, 160, stream_k=True),
    "gemm grouped, 3 products, stream-K": _grouped_case((296, 136, 520), 776, 1000, stream_k=True),
    "gemm grouped, 3 summed terms, stream-K": _summed_case(300, 776, (1000, 136, 72), stream_k=True),
    # 154 and 150 rows: the one-launch path (two clusters where the device holds two, as the
    # H200 does); 422 rows: row kernel + column sum
    "013 one launch": _problem_case("fused_residual_rmsnorm_backward", 2, 77, dims={"hidden": 1000}),
    "013 one launch, normalized=None": _problem_case("fused_residual_rmsnorm_backward", 3, 50,
                                                     without_normalized=True, consistent=True),
    "013 two launches": _problem_case("fused_residual_rmsnorm_backward", 2, 211, dims={"hidden": 1000}),
    "013 two launches, normalized=None": _problem_case("fused_residual_rmsnorm_backward", 2, 211,
                                                       without_normalized=True, consistent=True),
    "051": _problem_case("qkv_qknorm_backward", 2, 131),
    # 37 tokens a sequence: attn_weights copied into padded rows; four query heads over two kv heads
    "056": _problem_case("decoder_layer_backward", 2, 37, dims={"hidden": 256, "q_heads": 4, "kv_heads": 2,
                                                               "head_dim": 32, "intermediate": 320}),
    "051 head_dim 128": _problem_case("qkv_qknorm_backward", 3, 37,
                                      dims={"head_dim": 128, "q_heads": 2, "hidden": 648}),
    "087": _problem_case("embedding_rmsnorm_backward", 2, 300, dims={"vocab": 97, "hidden": 2560},
                         kernel_options={"vocab_size": 97}),
    "087 int32 ids, vocabulary of 17": _problem_case("embedding_rmsnorm_backward", 1, 64,
                                                     dims={"vocab": 17, "hidden": 1000},
                                                     kernel_options={"vocab_size": 17}, ids_dtype=torch.int32),
    "087 accumulate": _accumulate_case(2, 300, 97, 2560),
    # above 1024 tokens the ids are sorted by our radix sort, not on chip; above id_radix.MAX_TOKENS
    # (131072) by PyTorch, on RangeAndKeys' int16 keys; vocabularies above 65536: PyTorch's int32 sort
    "087 ids sorted by PyTorch, vocabulary of 70000": _problem_case(
        "embedding_rmsnorm_backward", 2, 700, dims={"vocab": 70000, "hidden": 1000}, kernel_options={"vocab_size": 70000}),
    "087 radix sort": _problem_case("embedding_rmsnorm_backward", 3, 1000, dims={"vocab": 97, "hidden": 256},
                                    kernel_options={"vocab_size": 97}),
    "087 range and int16 keys": _problem_case("embedding_rmsnorm_backward", 1, 131073, dims={"vocab": 97, "hidden": 64},
                                              kernel_options={"vocab_size": 97}),
    # an id out of range on each index pass: nothing written, the error recorded
    "087 bad ids, sorted on chip": _bad_ids_case(2, 300, 97, 256),
    "087 bad ids, radix sort": _bad_ids_case(3, 1000, 97, 256),
    "087 bad ids, range and int16 keys": _bad_ids_case(1, 131073, 97, 64),
    "087 bad ids, vocabulary of 70000": _bad_ids_case(2, 700, 70000, 256),
}


def run_cases(only: str) -> None:
    for name, case in CASES.items():
        if only in name:
            progress(f"sanitize: {name}")
            case()
            torch.cuda.synchronize()


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    path = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer")
    return path if os.path.exists(path) else None


def main(argv=None) -> int:
    parser = tool_parser("sanitize", __doc__)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # the process under a tool
    args = parser.parse_args(argv)
    if args.inside:
        run_cases(args.only)
        return 0
    if not have_gpu("sanitize"):
        return 2
    sanitizer = find_sanitizer()
    if not sanitizer:
        progress("sanitize: compute-sanitizer not found (PATH, CUDA_HOME/bin)")
        return 1
    failed = []
    for tool in args.tools.split(","):
        progress(f"sanitize: --tool {tool}")
        # API errors are not reported: torch and the driver bindings probe optional entry points
        # (cuGetProcAddress -> CUDA_ERROR_INVALID_VALUE) on every run; device accesses still are.
        command = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "1",
                   sys.executable, "-m", "cutebwd.tools.sanitize", "--inside", "--only", args.only]
        if subprocess.run(command).returncode:
            failed.append(tool)
    print("compute-sanitizer:", ", ".join(f"{t} {'FAILED' if t in failed else 'clean'}"
                                         for t in args.tools.split(",")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
