"""051 norm rows: the candidate rows (rows_candidate.patch applied) against the rows it replaces,
alone and inside the op, on the H200. Session 26 wrote it; it has not run (no device time left).

    git show <base>:kernels/qk_norm_rows.py > .scratch/rows_old.py     # the rows to compare with
    git apply tools/reports/pending/rows_candidate.patch
    python3 tools/reports/pending/ab_rows.py .scratch/rows_old.py      # ~3-4 min on a warm H200

Prints, per token count, us a call (graph replay, turn by turn) and TB/s for the rows alone
(a kernel of the GEMM CTA's 384 threads on one CTA per SM, as in the summed product's
prologue), then the op's us a call for each variant, parity first on NaN-poisoned outputs.
"""
import importlib.util
import sys

import torch
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutebwd.kernels import qk_norm_rows as R
from cutebwd.kernels import qkv_qknorm_backward as M
from cutebwd.kernels import runtime
from cutebwd.layouts.gemm import GemmTiling
from cutebwd.references import PROBLEMS
from cutebwd.tools import timing
from cutebwd.tools.parity import check_problem, held

D, HEADS = 256, 4
spec = importlib.util.spec_from_file_location("rows_old", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
# name -> the rows object (head_dim, in_flight, token-major q rows, ring slots)
VARIANTS = {"old": lambda: old.QkNormBackward(D, 4),
            "f4": lambda: R.QkNormBackward(D, 4),
            "f4_token": lambda: R.QkNormBackward(D, 4, True),
            "ring3": lambda: R.QkNormBackward(D, 1, False, 3),
            "ring3_token": lambda: R.QkNormBackward(D, 1, True, 3)}
ALONE_ONLY = {"ring4": lambda: R.QkNormBackward(D, 1, False, 4),  # 72 KB: more than some tilings' A stages
              "ring6": lambda: R.QkNormBackward(D, 1, False, 6)}


class RowsAlone:
    """The rows as a kernel of their own: `threads` a CTA, one CTA per SM."""

    def __init__(self, norm, threads=384):
        self.norm, self.threads = norm, threads

    @cute.jit
    def __call__(self, grad_q, pre_q, rstd_q, normed_q, weight_q, grad_k, pre_k, rstd_k, normed_k, weight_k,
                 dqk: cute.Tensor, norm_partials: cute.Tensor, grid: Int32, stream):
        batch, seq, row = grad_q.shape[0], grad_q.shape[2], (HEADS + 1) * D
        dq = cute.make_tensor(dqk.iterator, cute.make_layout((batch, seq, HEADS, D), stride=(seq * row, row, D, 1)))
        dk = cute.make_tensor(dqk.iterator + HEADS * D,
                              cute.make_layout((batch, seq, 1, D), stride=(seq * row, row, D, 1)))
        args = self.norm.arguments(grad_q, pre_q, rstd_q, normed_q, weight_q, dq, grad_k, pre_k, rstd_k, normed_k,
                                   weight_k, dk, M.rows(norm_partials, grid, 2 * D, 2 * D))
        self.kernel(args).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        scratch = cutlass.memory.SmemAllocator().allocate_tensor(
            Float32, cute.make_layout((self.norm.scratch_bytes(self.threads) // 4,)), byte_alignment=128)
        self.norm.run(args, scratch.iterator, tidx, self.threads)


def build_alone(name, make):
    fake = M._fake_args(D, HEADS, 640, GemmTiling(), GemmTiling())
    args = (*fake[:10], fake[21], fake[22], Int32(1), runtime.env_stream())
    return runtime.ffi_function(runtime.compile_kernel(("ab_rows", name), RowsAlone(make()), *args, arch="sm_90a",
                                                       tvm_ffi=True))


def rows_alone(tokens, variants):
    P = PROBLEMS["qkv_qknorm_backward"]
    x = P.make_inputs(1, tokens, device="cuda", seed=3)
    g_q, g_k, _, _, _, _, _, w_q, w_k, pre_q, pre_k, r_q, r_k, n_q, n_k = x[:15]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dqk = torch.empty(tokens * (HEADS + 1) * D, dtype=torch.bfloat16, device="cuda")
    parts = torch.empty(sms, 2 * D, dtype=torch.float32, device="cuda")
    args = (g_q, pre_q, r_q, n_q, w_q, g_k, pre_k, r_k, n_k, w_k, dqk, parts, sms)
    want, first = None, None  # the first variant that ran, which the others are compared with
    calls = {}
    for name, make in variants.items():
        try:
            run = build_alone(name, make)
            dqk.fill_(float("nan"))
            run(*args)
            got = dqk.clone()
        except Exception as e:  # one variant's failure should not cost the others' figures
            print(f"alone T={tokens} {name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        if want is None:
            want, first = got, name
        print(f"alone T={tokens} {name}: dq/dk equal to {first}'s: {torch.equal(got, want)}",
              flush=True)
        calls[name] = lambda run=run: run(*args)
    src = torch.randn(21 * 2**20, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    calls["copy_84MB"] = lambda: dst.copy_(src)
    moved = tokens * (HEADS + 1) * D * 2 * 4  # three bf16 rows read, one written
    for name, us in timing.interleaved_us(calls, seconds=3.0).items():
        print(f"alone T={tokens} {name:12s} {us:7.2f} us  {(moved if name != 'copy_84MB' else 4 * src.numel()) / us / 1e6:.2f} TB/s",
              flush=True)


def op(batch, seq, names):
    P = PROBLEMS["qkv_qknorm_backward"]
    compile_kernel, calls = runtime.compile_kernel, {}
    for name in names:
        M.QkNormBackward = lambda head_dim, in_flight=4, make=VARIANTS[name]: make()
        runtime.compile_kernel = lambda key, *a, name=name, **k: compile_kernel((*key, name), *a, **k)
        M._plans.clear()
        try:
            ok = all(held(r) for r in check_problem(P, M.qkv_qknorm_backward, batch, seq, seed=7))
        except Exception as e:  # a parity miss, or a build or launch that failed
            print(f"op {batch}x{seq} {name}: {type(e).__name__}: {e}", flush=True)
            ok = False
        print(f"op {batch}x{seq} {name}: parity {'ok' if ok else 'FAILED'}", flush=True)
        if ok:
            key, plan = next(iter(M._plans.items()))
            x = P.make_inputs(batch, seq, device="cuda", seed=1)
            out = M._outputs(None, *x[3:7], D)
            calls[name] = lambda key=key, plan=plan, x=x, out=out: (M._plans.__setitem__(key, plan),
                                                                  M.qkv_qknorm_backward(*x, out=out))
    runtime.compile_kernel = compile_kernel
    res = timing.interleaved_us(calls, seconds=3.0)
    print(f"op {batch}x{seq} T={batch * seq}: " + "  ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    for tokens in (4096, 8192):
        rows_alone(tokens, {**VARIANTS, **ALONE_ONLY})
    for batch, seq in ((1, 8192), (1, 4096), (16, 541), (1, 1024), (2, 128)):
        op(batch, seq, list(VARIANTS))
