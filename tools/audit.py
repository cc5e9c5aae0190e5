"""Machine-code audit: compile every registered kernel for sm_90a and sm_100a from fake
arguments (no GPU needed), disassemble each cubin with nvdisasm, count instruction families,
and check each build against what its kernel declares it must (and must not) contain.

    python -m cutebwd.tools.audit [--json audit.json] [--only SUBSTRING] [--keep DIR]

Exit status 1 when any build misses a required family or holds a forbidden one.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from cutebwd.kernels.runtime import ARCHES

# Families shown in the table, in order. LDG.n / STG.n are global loads/stores n bits wide;
# LDGSTS is cp.async (global to shared without registers). ATOM/RED counts every global atomic
# or reduction; ATOM/RED.FLOAT, a subset of it, those on floating-point data (their order, and
# so the result's bits, changes run to run), e.g. ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU against an
# integer counter's ATOMG.E.ADD.STRONG.GPU or REDG.E.ADD.S32.STRONG.GPU.
FAMILIES = ("HGMMA", "UTCMMA", "UTMALDG", "UTMASTG", "LDTM", "STTM", "LDG.128", "LDG.64",
            "LDG.32", "LDG.16", "LDG.8", "STG.128", "STG.64", "STG.32", "STG.16", "STG.8",
            "LDGSTS", "LDS", "STS", "SHFL", "ATOM/RED", "ATOM/RED.FLOAT", "LOCAL")

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")


def find_nvdisasm() -> str:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, else from PATH / CUDA_HOME."""
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13", "cuda_nvdisasm", "cu12"):
                path = os.path.join(root, sub, "bin", "nvdisasm")
                if os.path.exists(path):
                    return path
    except ImportError:
        pass
    for path in (shutil.which("nvdisasm"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvdisasm")):
        if path and os.path.exists(path):
            return path
    raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")


def _access_width(opcode: str) -> int:
    parts = opcode.split(".")
    for bits in ("128", "64"):
        if bits in parts:
            return int(bits)
    if any(p in ("U16", "S16") for p in parts):
        return 16
    if any(p in ("U8", "S8") for p in parts):
        return 8
    return 32


def family_of(opcode: str) -> str | None:
    """The audit family an SASS opcode belongs to, or None if it is not one we count."""
    base = opcode.split(".")[0]
    if base == "HGMMA":
        return "HGMMA"
    if base.startswith("UTC") and "MMA" in base:
        return "UTCMMA"
    if base in ("UTMALDG", "UTMASTG", "LDTM", "STTM", "LDGSTS", "LDS", "STS", "SHFL"):
        return base
    if base in ("LDG", "STG"):
        return f"{base}.{_access_width(opcode)}"
    if base in ("ATOM", "ATOMG", "RED", "REDG"):
        return "ATOM/RED"
    if base in ("LDL", "STL"):
        return "LOCAL"
    return None


_FLOAT_TYPE = re.compile(r"B?F(16|32|64)")  # F32, F16x2, BF16_V2, F64, ...


def is_float_atomic(opcode: str) -> bool:
    """An atomic or reduction on floating-point data (its type is an opcode part: .F32, .BF16x2, ..)."""
    return family_of(opcode) == "ATOM/RED" and any(_FLOAT_TYPE.match(p) for p in opcode.split(".")[1:])


def count_instructions(sass: str):
    """(opcode counts, family counts) of an nvdisasm listing."""
    opcodes = collections.Counter(m.group(1) for m in _INSTRUCTION.finditer(sass))
    families = collections.Counter()
    for opcode, n in opcodes.items():
        family = family_of(opcode)
        if family:
            families[family] += n
        if is_float_atomic(opcode):
            families["ATOM/RED.FLOAT"] += n
    return opcodes, families


_EIATTR = {0x2F: "registers", 0x11: "frame_bytes", 0x23: "max_stack_bytes"}


def cubin_resources(cubin: bytes) -> dict:
    """Per kernel: registers per thread, stack frame bytes, static shared memory bytes, read
    from the cubin's ELF: the .nv.info attribute table (EIATTR_REGCOUNT, _FRAME_SIZE,
    _MAX_STACK_SIZE, each keyed by symbol) and the .nv.shared.<kernel> section sizes."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def cstr(offset):
        return cubin[offset:cubin.index(b"\0", offset)].decode()

    sections = {cstr(headers[shstrndx][4] + h[0]): h for h in headers}
    symtab, strtab = sections[".symtab"], sections[".strtab"]
    symbols = [cstr(strtab[4] + struct.unpack_from("<I", cubin, symtab[4] + i * 24)[0])
               for i in range(symtab[5] // 24)]
    resources: dict[str, dict] = {}
    info = sections.get(".nv.info")
    if info:
        pos, end = info[4], info[4] + info[5]
        while pos + 4 <= end:
            fmt, attr, value = struct.unpack_from("<BBH", cubin, pos)
            pos += 4
            if fmt == 0x04:  # EIFMT_SVAL: `value` bytes of payload follow
                if attr in _EIATTR and value == 8:
                    sym, amount = struct.unpack_from("<II", cubin, pos)
                    resources.setdefault(symbols[sym], {})[_EIATTR[attr]] = amount
                pos += value
    for section, h in sections.items():
        if section.startswith(".nv.shared.") and not section.startswith(".nv.shared.reserved"):
            resources.setdefault(section[len(".nv.shared."):], {})["static_smem_bytes"] = h[5]
    return resources


def audit_build(build, arch: str, nvdisasm: str, keep_dir: str | None = None) -> dict:
    """Compile one build for `arch`, disassemble it, return its counts and resources."""
    with tempfile.TemporaryDirectory() as tmp:
        dump_dir = os.path.join(keep_dir or tmp, arch)
        start = time.perf_counter()
        compiled = build(arch, dump_dir)
        compile_s = time.perf_counter() - start
        cubin = compiled.artifacts.CUBIN
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([nvdisasm, "-c", path], check=True, capture_output=True, text=True).stdout
    opcodes, families = count_instructions(sass)
    target = re.search(r"EF_CUDA_SM(\d+)|\.target\s+sm_(\d+)", sass)
    return {"target": f"sm_{target.group(1) or target.group(2)}" if target else None, "compile_s": round(compile_s, 3),
            "families": dict(families), "opcodes": dict(opcodes), "resources": cubin_resources(cubin)}


def violations(result: dict, expects: dict) -> list[str]:
    """What a build's machine code misses or holds against its kernel's declaration."""
    problems = []
    if result["target"] != result["arch"].rstrip("a"):
        problems.append(f"cubin targets {result['target']}, expected {result['arch']}")
    rule = expects.get(result["arch"], {})
    for family in rule.get("require", ()):
        if not result["families"].get(family):
            problems.append(f"required {family} missing")
    for family in rule.get("forbid", ()):
        if result["families"].get(family):
            problems.append(f"forbidden {family} present ({result['families'][family]})")
    return problems


def run_audit(only: str | None = None, keep_dir: str | None = None, progress=print) -> list[dict]:
    from cutebwd.kernels.registry import audit_builds

    nvdisasm = find_nvdisasm()
    results = []
    for name, build, expects in audit_builds():
        if only and only not in name:
            continue
        for arch in (a for a in ARCHES if a in expects):  # a build exists for the arches it names
            progress(f"[audit] {name} {arch} ...")
            result = {"kernel": name, "arch": arch, **audit_build(build, arch, nvdisasm, keep_dir)}
            result["violations"] = violations(result, expects)
            results.append(result)
    return results


def format_table(results: list[dict]) -> str:
    shown = [f for f in FAMILIES if any(r["families"].get(f) for r in results)]
    header = ["kernel", "arch", "regs", *shown, "check"]
    rows = []
    for r in results:
        regs = max((v.get("registers", 0) for v in r["resources"].values()), default=0)
        rows.append([r["kernel"], r["arch"], str(regs), *(str(r["families"].get(f, 0)) for f in shown),
                     "ok" if not r["violations"] else "FAIL: " + "; ".join(r["violations"])])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header, *rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="audit.json", help="where to write the full results")
    parser.add_argument("--only", help="audit only builds whose name contains this")
    parser.add_argument("--keep", help="keep PTX and CUBIN files under this folder")
    args = parser.parse_args(argv)
    results = run_audit(args.only, args.keep, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(results))
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.json}")
    return 1 if any(r["violations"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
