"""The compile cache: fill it, time it, clear it. Needs no GPU (builds compile from fake
arguments for the arch named).

    python -m cutebwd.tools.compile_cache [--arch sm_90a] [--only SUBSTRING]   # fill
    python -m cutebwd.tools.compile_cache --times [--arch sm_90a] [--only SUBSTRING] [--json F]
    python -m cutebwd.tools.compile_cache --clear

Builds are the registered ones (kernels/registry.py, what the audit compiles). `--times` fills
a fresh temporary cache in one process (cold: compile and export) and reads it back in a
second (warm: load), and prints both per build.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from cutebwd.tools import tool_parser


def fill(arch: str, only: str | None, progress=print) -> list[dict]:
    """Builds every registered build for `arch` through the cache; per build, its seconds and
    whether it was compiled or loaded from disk."""
    from cutebwd.kernels import runtime
    from cutebwd.kernels.registry import audit_builds

    chosen = [(name, build) for name, build, expects in audit_builds()
              if arch in expects and (not only or only in name)]
    rows = []
    for i, (name, build) in enumerate(chosen, 1):
        start = time.perf_counter()
        compiled = build(arch, None)
        seconds = time.perf_counter() - start
        how = "loaded" if isinstance(compiled, runtime.Loaded) else "compiled"
        rows.append({"build": name, "arch": arch, "seconds": seconds, "how": how})
        progress(f"[{i}/{len(chosen)}] {name} {arch}: {how} in {seconds:.3f} s")
    return rows


def _child(arch: str, only: str | None, cache: str) -> list[dict]:
    command = [sys.executable, "-m", "cutebwd.tools.compile_cache", "--arch", arch, "--json", "-"]
    if only:
        command += ["--only", only]
    result = subprocess.run(command, env={**os.environ, "CUTEBWD_CACHE_DIR": cache}, check=True,
                            stdout=subprocess.PIPE, text=True)
    return json.loads(result.stdout)


def times(arch: str, only: str | None, progress=print) -> list[dict]:
    """Cold and warm seconds per build, against a fresh temporary cache."""
    with tempfile.TemporaryDirectory(prefix="cutebwd-cache-") as cache:
        progress("cold: compiling every build into an empty cache ...")
        cold = _child(arch, only, cache)
        progress("warm: a new process loading them ...")
        warm = {row["build"]: row for row in _child(arch, only, cache)}
    return [{"build": row["build"], "arch": arch, "cold s": row["seconds"], "cold how": row["how"],
             "warm s": warm[row["build"]]["seconds"], "warm how": warm[row["build"]]["how"]} for row in cold]


def format_times(rows: list[dict]) -> str:
    lines = [f"{'build':64} {'cold s':>8} {'warm ms':>8}  warm"]
    for r in rows:
        lines.append(f"{r['build'][:64]:64} {r['cold s']:8.2f} {1000 * r['warm s']:8.1f}  {r['warm how']}")
    lines.append(f"{'total':64} {sum(r['cold s'] for r in rows):8.2f} {1000 * sum(r['warm s'] for r in rows):8.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from cutebwd.kernels import disk_cache
    from cutebwd.kernels.runtime import ARCHES

    parser = tool_parser("compile_cache", __doc__)
    parser.add_argument("--arch", default="sm_90a", choices=ARCHES)
    parser.add_argument("--only", help="only builds whose name contains this")
    parser.add_argument("--times", action="store_true", help="cold and warm times against a fresh cache")
    parser.add_argument("--clear", action="store_true", help="delete the cache directory")
    parser.add_argument("--json", help="write the rows here ('-': to stdout, progress to stderr)")
    args = parser.parse_args(argv)
    progress = (lambda m: print(m, file=sys.stderr, flush=True))
    if args.clear:
        root = disk_cache.directory()
        if root is not None and root.exists():
            shutil.rmtree(root)
        print(f"cleared {root}")
        return 0
    if disk_cache.directory() is None:
        progress(f"note: {disk_cache.ENV}=off, so nothing is kept on disk")
    rows = (times if args.times else fill)(args.arch, args.only, progress)
    if args.json == "-":
        json.dump(rows, sys.stdout)
        return 0
    print(format_times(rows) if args.times else f"{len(rows)} builds in {disk_cache.directory()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
