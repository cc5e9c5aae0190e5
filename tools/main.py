"""The main job. With no GPU: compile every kernel for sm_90a and sm_100a and audit the
machine code (and say that is all it could do). With a GPU: the GPU parity tests, then the
benchmark.

    python -m cutebwd.tools.main [bench options ...]
"""
from __future__ import annotations

import os
import subprocess
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from cutebwd.tools import audit

    import torch

    status = audit.main(["--json", "audit.json"])
    if not torch.cuda.is_available():
        print("\nno CUDA GPU here: compiled and audited both architectures (sm_90a, sm_100a); "
              "parity checks and timings need a GPU")
        return status
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    status |= subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", tests])
    from cutebwd.tools import bench

    return status | bench.main(argv)


if __name__ == "__main__":
    sys.exit(main())
