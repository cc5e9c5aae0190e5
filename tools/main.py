"""The main job. With no GPU: compile every kernel for sm_90a and sm_100a and audit the
machine code, then the same for every build dispatch makes on an H200 and a B200 (and say that
is all it could do). With a GPU: also the GPU tests, then the benchmark.

    python -m cutebwd.tools.main [--no-bench] [-- bench options ...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from cutebwd.tools import tool_parser


def main(argv=None) -> int:
    parser = tool_parser("main", "Audit every kernel for sm_90a and sm_100a, and every build dispatch makes on an "
                                 "H200 and a B200 (no GPU needed; about 5 minutes on 2 cores); with a GPU, then the "
                                 "GPU tests and the benchmark.")
    parser.add_argument("--no-bench", action="store_true", help="stop after the audit and the GPU tests")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="after --: options for python -m cutebwd.tools.bench")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    sys.argv = sys.argv[:1]  # the DSL reads the command line when it is imported: show it none of ours

    import torch

    from cutebwd.tools import audit

    print("[main] audit: every kernel compiled for sm_90a and sm_100a and its machine code checked", flush=True)
    status = audit.main(["--json", "audit.json"])
    print("[main] dispatch audit: every build the ops' first calls make on an H200 and a B200", flush=True)
    status |= audit.main(["--dispatch", "--json", "audit-dispatch.json"])
    if not torch.cuda.is_available():
        print("\nno CUDA GPU here: compiled and audited both architectures (sm_90a, sm_100a); "
              "the GPU tests and timings need a GPU")
        return status
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    print("[main] GPU tests", flush=True)
    status |= subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", tests])
    if args.no_bench:
        return status
    from cutebwd.tools import bench

    print("[main] bench", flush=True)
    return status | bench.main(bench_args)


if __name__ == "__main__":
    sys.exit(main())
