"""The correctness bar of semantics.md (version 2), in one place for tests, bench and tune.

Per output tensor, against the benchmark-style reference `ref` (the contract as written, in
its declared dtypes) and the exact evaluation `exact` (float64, no intermediate rounding):

1. the benchmark's rule: |out - ref| <= atol + RTOL * |ref| on at least 99% of elements, with
   the workload's atol; any NaN or Inf in either tensor fails; an all-zero output against a
   nonzero reference fails;
2. accuracy: ||out - exact|| / ||exact|| <= 2 * ||ref - exact|| / ||exact|| + 1e-5
   (relative Frobenius; FlashAttention's convention);
3. outputs are handed over poisoned (NaN) or zero-filled, so an unwritten element fails.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cutebwd.references.workloads import RTOL

MIN_CLOSE_FRACTION = 0.99
EXACT_FACTOR = 2.0  # out may be this many times further from the exact gradient than ref is
EXACT_SLACK = 1e-5
FILLS = ("nan", "zeros")  # how check_problem preallocates outputs


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius) in float64; 0 when both are zero."""
    got, want = got.detach().double(), want.detach().double()
    want_norm = torch.linalg.norm(want).item()
    diff_norm = torch.linalg.norm(got - want).item()
    if want_norm == 0:
        return 0.0 if diff_norm == 0 else float("inf")
    return diff_norm / want_norm


@dataclass
class OutputReport:
    name: str
    close_fraction: float  # of elements within atol + RTOL * |ref|
    atol: float
    nonfinite: int  # NaN or Inf elements in out
    ref_nonfinite: int  # NaN or Inf elements in the reference (the benchmark fails those too)
    all_zero: bool  # out is all zeros where the reference is not
    error: float  # relative Frobenius error of out against the exact evaluation
    ref_error: float  # the same for the benchmark-style reference; nan when no exact evaluation
    max_abs_error: float  # against the reference, over finite elements

    @property
    def error_limit(self) -> float:
        return EXACT_FACTOR * self.ref_error + EXACT_SLACK

    @property
    def benchmark_ok(self) -> bool:
        return (self.nonfinite == 0 and self.ref_nonfinite == 0 and not self.all_zero
                and self.close_fraction >= MIN_CLOSE_FRACTION)

    @property
    def accuracy_ok(self) -> bool:
        return math.isnan(self.ref_error) or self.error <= self.error_limit  # nan: not measured

    @property
    def ok(self) -> bool:
        return self.benchmark_ok and self.accuracy_ok

    def line(self) -> str:
        return (f"{'ok  ' if self.ok else 'FAIL'} {self.name:<26} close {self.close_fraction:8.4%} (atol {self.atol:.2g})"
                f"  err {self.error:.2e} (<= {self.error_limit:.2e}, ref {self.ref_error:.2e})"
                f"  max_abs {self.max_abs_error:.3e}  nonfinite {self.nonfinite}/{self.ref_nonfinite}"
                f"{'  ALL ZERO' if self.all_zero else ''}")


def check_output(name: str, out: torch.Tensor, ref: torch.Tensor, atol: float,
                 exact: torch.Tensor | None = None) -> OutputReport:
    """One output against the bar; without `exact` only the benchmark's rule is checked."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    out64, ref64 = out.detach().double(), ref.detach().double()
    out_finite, ref_finite = torch.isfinite(out64), torch.isfinite(ref64)
    both = out_finite & ref_finite
    err = (out64 - ref64).abs()
    close = both & (err <= atol + RTOL * ref64.abs())
    all_zero = bool((out64 == 0).all()) and bool((ref64 != 0).any())
    max_abs = err[both].max().item() if both.any() else 0.0
    if exact is None:
        error = ref_error = float("nan")
    elif not bool(torch.isfinite(exact).all()):
        # its norm would be NaN, and a NaN ref_error reads as "not measured": the half would pass unseen
        raise AssertionError(f"{name}: the exact evaluation holds NaN or Inf; the accuracy check cannot run")
    else:
        error = relative_error(torch.where(out_finite, out64, torch.zeros_like(out64)), exact)
        ref_error = relative_error(torch.where(ref_finite, ref64, torch.zeros_like(ref64)), exact)
    return OutputReport(name, close.sum().item() / max(out.numel(), 1), atol, int((~out_finite).sum()),
                        int((~ref_finite).sum()), all_zero, error, ref_error, max_abs)


def check_outputs(names, outs, refs, atol: float, exacts=None) -> list[OutputReport]:
    if not (len(names) == len(outs) == len(refs)):
        raise AssertionError(f"expected {len(names)} outputs, got {len(outs)} (reference {len(refs)})")
    exacts = exacts if exacts is not None else [None] * len(names)
    return [check_output(n, o, r, atol, e) for n, o, r, e in zip(names, outs, refs, exacts, strict=True)]


def assert_parity(names, outs, refs, atol: float, exacts=None, context: str = "") -> list[OutputReport]:
    """Check every output; raise one AssertionError listing every output's figures if any fails."""
    reports = check_outputs(names, outs, refs, atol, exacts)
    if not all(r.ok for r in reports):
        raise AssertionError(f"parity failed {context}\n" + "\n".join(r.line() for r in reports))
    return reports


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer shaped like `t`, filled with NaN (or the max value for integer dtypes),
    so an element the kernel never writes cannot pass the check."""
    out = torch.empty_like(t)
    if out.is_floating_point():
        out.fill_(float("nan"))
    else:
        out.fill_(torch.iinfo(out.dtype).max)
    return out


def preallocated(refs, fill: str) -> tuple:
    """Output buffers shaped and typed like the reference's outputs: NaN-poisoned or zeros."""
    if fill not in FILLS:
        raise ValueError(f"fill: expected one of {FILLS}, got {fill!r}")
    return tuple(poisoned_like(r) if fill == "nan" else torch.zeros_like(r) for r in refs)


def assert_problem(problem, inputs, outputs, batch: int, seq: int, *, dims=None, context: str = "",
                   **reference_options) -> list[OutputReport]:
    """Outputs a kernel made from `inputs` (e.g. captured in a graph or on another stream) held to
    the bar; reference_options go to the reference (the embedding backward's accumulate_into)."""
    expected = problem.run_reference(inputs, dims=dims, **reference_options)
    exact = problem.run_exact(inputs, dims=dims, **reference_options)
    for name, out, ref in zip(problem.output_names, outputs, expected):
        if out.dtype != ref.dtype:  # the numbers could pass in a wider dtype; the contract fixes it
            raise AssertionError(f"{problem.name}: {name} is {out.dtype}, the contract's is {ref.dtype} {context}")
    return assert_parity(problem.output_names, outputs, expected, problem.atol(seq, batch), exact,
                         f"{problem.name} batch={batch} seq={seq} {context}")


def check_problem(problem, kernel, batch: int, seq: int, *, seed: int = 0, dims=None, fills=("nan",),
                  rounds: int = 1, kernel_options=None, **input_options) -> list[OutputReport]:
    """The one parity check for a problem's kernel, as the benchmark runs it: `rounds` rounds of
    fresh inputs (seeds seed, seed + 1, ...), the reference and the exact evaluation made once a
    round, and per round one call for each of `fills` ("nan", "zeros": how the outputs are
    preallocated before they are handed over as `out=`). Every output is held to the bar with
    the workload's atol (the nearest workload's for other shapes); the first failure raises.
    Returns the last call's reports.

    `kernel(*inputs, out=outputs, **kernel_options)` must write every output in place.
    """
    reports = []
    for round_seed in range(seed, seed + rounds):
        inputs = problem.make_inputs(batch, seq, device="cuda", seed=round_seed, dims=dims, **input_options)
        expected = problem.run_reference(inputs, dims=dims)
        exact = problem.run_exact(inputs, dims=dims)
        for fill in fills:
            outputs = preallocated(expected, fill)
            kernel(*inputs, out=outputs, **(kernel_options or {}))
            reports = assert_parity(problem.output_names, outputs, expected, problem.atol(seq, batch), exact,
                                    f"{problem.name} batch={batch} seq={seq} seed={round_seed} fill={fill} "
                                    f"{input_options or ''}")
            del outputs
        del inputs, expected, exact
    return reports


def op_for(problem, dims=None):
    """The cutebwd op named like the problem, as check_problem calls it (the embedding backward
    gets its vocabulary)."""
    import cutebwd

    op = getattr(cutebwd, problem.name)
    options = problem.dims_options({**problem.dims, **(dims or {})})
    if "vocab_size" in options:
        return lambda *inputs, out: op(*inputs, vocab_size=options["vocab_size"], out=out)
    return op


def main(argv=None) -> int:
    """Every workload of every problem held to the bar as the benchmark runs it: fresh inputs each
    round, outputs NaN-poisoned and zero-filled, one line per workload, a total per problem."""
    import time

    from cutebwd.references import PROBLEMS
    from cutebwd.tools import tool_parser
    from cutebwd.tools.timing import have_gpu, progress

    parser = tool_parser("parity", main.__doc__)
    parser.add_argument("--problem", action="append", choices=sorted(PROBLEMS), help="default: all four")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of fresh inputs per workload (default 10)")
    args = parser.parse_args(argv)
    if not have_gpu("parity"):
        return 2
    started, failed = time.perf_counter(), 0
    for name in args.problem or list(PROBLEMS):
        problem = PROBLEMS[name]
        passed = 0
        for i, (seq, batch) in enumerate(problem.workloads, 1):
            progress(f"[parity] {name} {i}/{len(problem.workloads)} {seq} x {batch} "
                     f"({time.perf_counter() - started:.0f} s)")
            try:
                reports = check_problem(problem, op_for(problem), batch, seq, seed=1000 * seq + batch,
                                        fills=FILLS, rounds=args.rounds)
            except AssertionError as error:
                print(f"{name} {seq} x {batch}: FAIL\n{error}", flush=True)
                continue
            passed += 1
            worst = min(reports, key=lambda r: r.close_fraction)
            print(f"{name} {seq} x {batch}: ok ({args.rounds} rounds x {len(FILLS)} fills); least close "
                  f"{worst.name} {worst.close_fraction:.4%}; largest err / limit "
                  f"{max(r.error / r.error_limit for r in reports):.2f}", flush=True)
            torch.cuda.empty_cache()
        failed += len(problem.workloads) - passed
        print(f"== {name}: {passed}/{len(problem.workloads)} workloads pass", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
