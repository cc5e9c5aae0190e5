"""What the correctness bar allows an exact implementation: each problem's reference evaluated
in float64 (the contract's math and bf16 roundings, no fp32 accumulation error) checked
against the fp32 reference the bar uses, output by output. Where this fails the bar, no
implementation can be held to it as it reads (056: tools/reports/056-plan.md, session 16).

    python -m cutebwd.tools.reference_floor [--problem NAME] [--workloads SEQxBATCH ...]
"""
from __future__ import annotations

import argparse

import torch

from cutebwd.references import PROBLEMS
from cutebwd.tools.parity import check_outputs
from cutebwd.tools.timing import progress


def floor(problem, batch: int, seq: int, device: str = "cuda", seed: int = 0, dims=None):
    """Parity reports of the float64 evaluation against the fp32 reference, on one draw."""
    inputs = problem.make_inputs(batch, seq, device=device, seed=seed, dims=dims)
    reference = problem.run_reference(inputs, dims=dims, fp32_outputs=True)
    exact = problem.run_reference([t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                                   for t in inputs], dims=dims, fp32_outputs=True)
    return check_outputs(problem.output_names, [t.float() for t in exact], reference, problem.output_dtypes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problem", default="decoder_layer_backward", choices=sorted(PROBLEMS))
    parser.add_argument("--workloads", nargs="*", help="SEQxBATCH (default: the problem's workloads)")
    args = parser.parse_args(argv)
    problem = PROBLEMS[args.problem]
    cases = [tuple(int(v) for v in w.split("x")) for w in args.workloads] if args.workloads else problem.workloads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for i, (seq, batch) in enumerate(cases, 1):
        progress(f"[floor] {problem.name} {i}/{len(cases)} {seq} x {batch}")
        for report in floor(problem, batch, seq, device, seed=seq * 100 + batch):
            print(f"{seq} x {batch}  {report.line()}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
