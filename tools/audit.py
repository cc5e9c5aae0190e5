"""Machine-code audit: compile every registered kernel for sm_90a and sm_100a from fake
arguments (no GPU needed), disassemble each cubin with nvdisasm, count instruction families,
and check each build against what its kernel declares it must (and must not) contain, and
against the hardware's per-CTA limits (registers, shared memory, tensor memory, cluster size).

    python -m cutebwd.tools.audit [--json audit.json] [--only SUBSTRING] [--keep DIR]
    python -m cutebwd.tools.audit --dispatch [--gpu H200 --gpu B200] [--only ...]

--dispatch audits what dispatch builds instead of the registry's builds: every kernel the ops'
first calls compile on an H200 and a B200 for every workload and some odd shapes
(tools/dispatch.py), each distinct build once; a build that does not compile is a violation.

Exit status 1 when any build misses a required family, holds a forbidden one, exceeds a limit
or does not compile.
"""
from __future__ import annotations

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

from cutebwd.layouts import gpus
from cutebwd.tools import tool_parser

# The arches audited (the DSL also builds sm_103a, the B300's target: tests/test_dispatch.py
# compiles a sample for it).
ARCHES = ("sm_90a", "sm_100a")

# Families shown in the table, in order. LDG.n / STG.n are global loads/stores n bits wide;
# LDGSTS is cp.async (global to shared without registers). ATOM/RED counts every global atomic
# or reduction; ATOM/RED.FLOAT, a subset of it, those on floating-point data (their order, and
# so the result's bits, changes run to run), e.g. ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU against an
# integer counter's ATOMG.E.ADD.STRONG.GPU or REDG.E.ADD.S32.STRONG.GPU.
FAMILIES = ("HGMMA", "UTCMMA", "UTMALDG", "UTMASTG", "LDTM", "STTM", "LDG.128", "LDG.64",
            "LDG.32", "LDG.16", "LDG.8", "STG.128", "STG.64", "STG.32", "STG.16", "STG.8",
            "LDGSTS", "LDS", "STS", "SHFL", "ATOM/RED", "ATOM/RED.FLOAT", "LOCAL", "HGMMA.SERIAL",
            "TMEM.WAIT.LD")
# HGMMA.SERIAL counts warpgroup-MMA waits for zero pending MMAs right before the next MMA
# (WARPGROUP.DEPBAR.LE gsb0, 0x0 then WARPGROUP.ARRIVE / HGMMA): ptxas serializes the MMAs
# that way when it cannot prove their registers safe (its C7520 "Potential Performance Loss"
# note, e.g. MMAs under a branch it takes for divergent), which halves a warpgroup's rate.
# TMEM.WAIT.LD counts tcgen05.wait::ld in the PTX (in SASS it is a plain scoreboard wait): a
# Blackwell epilogue must wait for its tensor-memory loads before handing the accumulator back.

# Hardware limits (CUDA C++ Programming Guide, technical specifications for compute capability
# 9.0 and 10.0). A build over one of them compiles here and fails at launch on the GPU.
MAX_REGISTERS_PER_THREAD = 255
# Shared memory per CTA, static + dynamic: the arch's table (layouts.gpus; the DSL's own check
# uses the same figure).
MAX_SMEM_BYTES = gpus.SMEM_PER_BLOCK
SMEM_RESERVED_BYTES = 1024  # that reservation; ptxas counts it into the cubin's static size
# Tensor memory (Blackwell only): 512 columns x 128 lanes per SM; tcgen05.alloc takes a power
# of two from 32 to 512 columns.
MAX_TMEM_COLUMNS = {"sm_100a": 512, "sm_103a": 512}
MIN_TMEM_COLUMNS = 32
# CTAs per cluster. 16 launch only with the non-portable opt-in (the DSL sets it on every
# kernel) and only on some parts, so anything above the portable 8 counts as a violation, unless
# the kernel's declaration raises it ("max_cluster_ctas") because its op asks the driver first.
MAX_CLUSTER_CTAS = gpus.MAX_CLUSTER_CTAS

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


def serialized_mma_waits(sass: str) -> int:
    """How many `WARPGROUP.DEPBAR.LE gsb0, 0x0` are followed at once by another warpgroup MMA."""
    listing = [(m.group(1), sass[m.end():sass.find("\n", m.end())]) for m in _INSTRUCTION.finditer(sass)]
    return sum(1 for (opcode, operands), (following, _) in zip(listing, listing[1:])
               if opcode == "WARPGROUP.DEPBAR.LE" and operands.replace(" ", "").startswith("gsb0,0x0")
               and (following == "WARPGROUP.ARRIVE" or following.startswith("HGMMA")))


def count_instructions(sass: str):
    """(opcode counts, family counts) of an nvdisasm listing."""
    opcodes = collections.Counter(m.group(1) for m in _INSTRUCTION.finditer(sass))
    families = collections.Counter()
    serial = serialized_mma_waits(sass)
    if serial:
        families["HGMMA.SERIAL"] = serial
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
    # On sm_90+ ptxas puts the system's 1 KB per-CTA reservation at the start of every kernel's
    # .nv.shared.<kernel> section (and adds an empty .nv.shared.reserved.0): a kernel that
    # declares 4096 bytes gets a 5120-byte section, which ptxas -v reports as "4096 bytes smem".
    # The reservation is not part of the 227 KB a CTA may ask for, so it is taken off here.
    reserved = SMEM_RESERVED_BYTES if any(s.startswith(".nv.shared.reserved") for s in sections) else 0
    for section, h in sections.items():
        if section.startswith(".nv.shared.") and not section.startswith(".nv.shared.reserved"):
            resources.setdefault(section[len(".nv.shared."):], {})["static_smem_bytes"] = max(h[5] - reserved, 0)
    return resources


_PTX_FUNCTION = re.compile(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\w+)")
_TMEM_ALLOC = re.compile(r"tcgen05\.alloc\.[\w:.]+\s+\[[^\]]+\],\s*(%?\w+);")
_MOV = re.compile(r"mov\.[bus]32\s+(%\w+),\s*(%?\w+);")
_REQ_CLUSTER = re.compile(r"\.reqnctapercluster\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_MAX_CLUSTER_RANK = re.compile(r"\.maxclusterrank\s+(\d+)")


def _ptx_constant(operand: str, body: str) -> int | None:
    """The value of a tcgen05.alloc operand: an immediate, or a register one `mov` of a
    constant (or of such a register) sets; None when it is computed at run time."""
    for _ in range(8):
        if operand.isdigit():
            return int(operand)
        sources = {src for reg, src in _MOV.findall(body) if reg == operand}
        if len(sources) != 1:
            return None
        operand = sources.pop()
    return None


def ptx_resources(ptx: str) -> dict:
    """Per PTX function: the tensor-memory columns each tcgen05.alloc asks for (None where not a
    compile-time constant), and the cluster shape its directives fix, if any (.reqnctapercluster
    and .maxclusterrank; the DSL usually sets the cluster at launch instead, see host_launches)."""
    heads = list(_PTX_FUNCTION.finditer(ptx))
    resources = {}
    for head, following in zip(heads, heads[1:] + [None]):
        body = ptx[head.start():following.start() if following else len(ptx)]
        found = {}
        allocs = [_ptx_constant(operand, body) for operand in _TMEM_ALLOC.findall(body)]
        if allocs:
            found["tmem_columns"] = allocs
        # The directives sit between the parameter list and the body's "{".
        directives = body[:body.find("{")] if "{" in body else body
        if m := _REQ_CLUSTER.search(directives):
            found["cluster"] = [int(d or 1) for d in m.groups()]
        if m := _MAX_CLUSTER_RANK.search(directives):
            found["max_cluster_rank"] = int(m.group(1))
        if found:
            resources[head.group(1)] = found
    return resources


# The DSL allocates shared memory dynamically (SmemAllocator, struct storage: the PTX holds
# only `.extern .shared ... __dynamic_shmem__0[]`, the cubin no size) and sets the cluster
# shape as a launch attribute, not a PTX directive. Both are fixed when the kernel is
# generated: the launch op takes `cute.kernel_smem_size @kernel`, which a later pass resolves
# to a constant, and the lowered host code (compiled.ir_module, LLVM dialect) builds a
# CUlaunchConfig for cuLaunchKernelEx from constants. So each launch's figures are read there:
# the i64 stored into the config's sharedMemBytes field, and the three i32 stored into the
# value of its CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION attribute. (At load the DSL sets
# CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to the device's opt-in maximum less the
# static size, so the launch's sharedMemBytes is the one figure that matters.)
_LAUNCH_CONFIG = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"  # grid, block, sharedMemBytes, stream, attrs, numAttrs
_LAUNCH_ATTRIBUTE = "!llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>"  # id, pad, value
_DIM3 = "!llvm.struct<(i32, i32, i32)>"
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4

_SSA = r"%[\w.$-]+"
_DEFINITION = re.compile(rf"^\s*({_SSA}) = (.*)$")
_GEP = re.compile(rf"llvm\.getelementptr (?:inbounds )?({_SSA})\[([\d, ]+)\] : .* -> !llvm\.ptr, (.+)$")
_STORE = re.compile(rf"^\s*llvm\.store ({_SSA}), ({_SSA}) ")
_LAUNCH_CALL = re.compile(rf"llvm\.call @_cudaLaunchKernelEx\(({_SSA}), ({_SSA}), ({_SSA})\)")
_HOST_CONSTANT = re.compile(r"llvm\.mlir\.constant\((-?\d+) : i\d+\)")


def host_launches(host_ir: str) -> list[dict]:
    """Each cuLaunchKernelEx in the DSL's lowered host code: {"kernel", "dynamic_smem_bytes"
    (None when not a compile-time constant), "cluster" ([x, y, z], [1, 1, 1] without one)}."""
    launches = []
    definitions: dict[str, str] = {}

    def constant(name):
        m = _HOST_CONSTANT.match(definitions.get(name, ""))
        return int(m.group(1)) if m else None

    def gep(name):  # (base, indices, element type) of a getelementptr, else None
        m = _GEP.match(definitions.get(name, ""))
        return (m.group(1), m.group(2).replace(" ", ""), m.group(3).strip()) if m else None

    smem, attribute_ids, dims = None, {}, {}
    for line in host_ir.splitlines():
        if line.lstrip().startswith("llvm.func "):
            definitions = {}  # SSA names are per function
        if m := _DEFINITION.match(line):
            definitions[m.group(1)] = m.group(2)
        if m := _STORE.match(line):
            value, field = constant(m.group(1)), gep(m.group(2))
            if field and field[1:] == ("0,2", _LAUNCH_CONFIG):
                smem = value
            elif field and field[1:] == ("0,0", _LAUNCH_ATTRIBUTE):
                attribute_ids[field[0]] = value
            elif field and field[2] == _DIM3 and (outer := gep(field[0])) and outer[1:] == ("0,2", _LAUNCH_ATTRIBUTE):
                dims.setdefault(outer[0], [1, 1, 1])[int(field[1].split(",")[1])] = value
        if m := _LAUNCH_CALL.search(line):
            # The kernel operand is a load of the host global @kernels_<kernel symbol>.
            loaded = re.match(rf"llvm\.load ({_SSA})", definitions.get(m.group(2), ""))
            symbol = re.match(r"llvm\.mlir\.addressof @(\w+)", definitions.get(loaded.group(1), "") if loaded else "")
            cluster = next((a for a, i in attribute_ids.items() if i == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION), None)
            launches.append({"kernel": symbol and re.sub(r"^kernels_", "", symbol.group(1)),
                             "dynamic_smem_bytes": smem, "cluster": dims.get(cluster, [1, 1, 1])})
            smem, attribute_ids, dims = None, {}, {}
    return launches


def audit_build(build, arch: str, nvdisasm: str, keep_dir: str | None = None) -> dict:
    """Compile one build for `arch`, disassemble it, return its counts, resources and launches."""
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
    if waits := compiled.artifacts.PTX.count("tcgen05.wait::ld"):
        families["TMEM.WAIT.LD"] = waits
    target = re.search(r"EF_CUDA_SM(\d+)|\.target\s+sm_(\d+)", sass)
    resources = cubin_resources(cubin)
    for kernel, found in ptx_resources(compiled.artifacts.PTX).items():
        resources.setdefault(kernel, {}).update(found)
    return {"target": f"sm_{target.group(1) or target.group(2)}" if target else None, "compile_s": round(compile_s, 3),
            "families": dict(families), "opcodes": dict(opcodes), "resources": resources,
            "launches": host_launches(str(compiled.ir_module))}


def smem_bytes(result: dict, launch: dict) -> int | None:
    """Shared memory one launch gives each CTA: its kernel's static size plus the dynamic size."""
    if launch["dynamic_smem_bytes"] is None:
        return None
    return result["resources"].get(launch["kernel"], {}).get("static_smem_bytes", 0) + launch["dynamic_smem_bytes"]


def _ctas(cluster) -> int:
    return cluster[0] * cluster[1] * cluster[2]


def limit_violations(result: dict, max_cluster_ctas: int | None = None) -> list[str]:
    """Where a build exceeds the hardware's per-CTA limits for its arch (a cluster limit other
    than the arch's portable one where given), or where a figure cannot be read (so cannot be
    checked)."""
    arch, problems = result["arch"], []
    max_cluster_ctas = max_cluster_ctas or MAX_CLUSTER_CTAS[arch]
    for kernel, r in result["resources"].items():
        if r.get("registers", 0) > MAX_REGISTERS_PER_THREAD:
            problems.append(f"{kernel}: {r['registers']} registers per thread > {MAX_REGISTERS_PER_THREAD}")
        for columns in r.get("tmem_columns", ()):
            if columns is None:
                problems.append(f"{kernel}: tcgen05.alloc column count is not a compile-time constant")
            elif not (MIN_TMEM_COLUMNS <= columns <= MAX_TMEM_COLUMNS.get(arch, 0) and columns & (columns - 1) == 0):
                problems.append(f"{kernel}: tcgen05.alloc of {columns} columns (a power of two from "
                                f"{MIN_TMEM_COLUMNS} to {MAX_TMEM_COLUMNS.get(arch, 0)} on {arch})")
        ctas = max(_ctas(r.get("cluster", (1, 1, 1))), r.get("max_cluster_rank", 1))
        if ctas > max_cluster_ctas:
            problems.append(f"{kernel}: cluster of {ctas} CTAs in its PTX > {max_cluster_ctas}")
    for launch in result["launches"]:
        total = smem_bytes(result, launch)
        if total is None:
            problems.append(f"{launch['kernel']}: launch's dynamic shared memory is not a compile-time constant")
        elif total > MAX_SMEM_BYTES[arch]:
            problems.append(f"{launch['kernel']}: {total} bytes of shared memory per CTA > {MAX_SMEM_BYTES[arch]}")
        if None in launch["cluster"]:
            problems.append(f"{launch['kernel']}: launch's cluster shape is not a compile-time constant")
        elif _ctas(launch["cluster"]) > max_cluster_ctas:
            problems.append(f"{launch['kernel']}: launched in clusters of {launch['cluster']} > {max_cluster_ctas} CTAs")
    # Every kernel in the cubin (those with a register count) must have a launch read above,
    # or its shared memory and cluster went unchecked.
    launched = {launch["kernel"] for launch in result["launches"]}
    for kernel, r in result["resources"].items():
        if "registers" in r and kernel not in launched:
            problems.append(f"{kernel}: no launch found in the host code")
    return problems


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


def build_problems(result: dict, expects: dict) -> list[str]:
    """Everything wrong with one build: against its declaration and against the hardware limits."""
    allowed = expects.get(result["arch"], {}).get("max_cluster_ctas")
    return violations(result, expects) + limit_violations(result, allowed)


def registered_builds(only: str | None = None) -> list:
    """(name, build, expects, arch) for every registered build whose name contains `only`."""
    from cutebwd.kernels.registry import audit_builds

    return [(name, build, expects, arch) for name, build, expects in audit_builds()
            if not only or only in name
            for arch in ARCHES if arch in expects]  # a build exists for the arches it names


def run_audit(only: str | None = None, keep_dir: str | None = None, progress=print) -> list[dict]:
    nvdisasm = find_nvdisasm()
    work = registered_builds(only)
    results = []
    for i, (name, build, expects, arch) in enumerate(work, 1):
        progress(f"[audit {i}/{len(work)}] {name} {arch} ...")
        result = {"kernel": name, "arch": arch, **audit_build(build, arch, nvdisasm, keep_dir)}
        result["violations"] = build_problems(result, expects)
        results.append(result)
    return results


def summary(results: list[dict]) -> str:
    """'N builds, N ok', then one line per failing build."""
    failed = [r for r in results if r["violations"]]
    return (f"{len(results)} builds, {len(results) - len(failed)} ok"
            + "".join(f"\nFAIL {r['kernel']} {r['arch']}: {'; '.join(r['violations'])}" for r in failed))


def resource_summary(result: dict) -> dict:
    """The build's largest figure of each limited resource, over its kernels and launches."""
    launches = result["launches"]
    smem = [smem_bytes(result, launch) for launch in launches]
    tmem = [c for r in result["resources"].values() for c in r.get("tmem_columns", ()) if c is not None]
    clusters = [launch["cluster"] for launch in launches if None not in launch["cluster"]]
    clusters += [r["cluster"] for r in result["resources"].values() if "cluster" in r]
    return {"regs": max((r.get("registers", 0) for r in result["resources"].values()), default=0),
            "smem_bytes": None if None in smem else max(smem, default=0),
            "tmem_columns": max(tmem, default=None),
            "cluster": max(clusters, key=_ctas, default=[1, 1, 1])}


def format_table(results: list[dict]) -> str:
    shown = [f for f in FAMILIES if any(r["families"].get(f) for r in results)]
    header = ["kernel", "arch", "regs", "smem KB", "tmem cols", "cluster", *shown, "check"]
    rows = []
    for r in results:
        used = resource_summary(r)
        smem = "?" if used["smem_bytes"] is None else f"{used['smem_bytes'] / 1024:.1f}"
        rows.append([r["kernel"], r["arch"], str(used["regs"]), smem, str(used["tmem_columns"] or "-"),
                     "x".join(map(str, used["cluster"])), *(str(r["families"].get(f, 0)) for f in shown),
                     "ok" if not r["violations"] else "FAIL: " + "; ".join(r["violations"])])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header, *rows])


def run_dispatch_audit(gpu_names=None, only: str | None = None, keep_dir: str | None = None, progress=print,
                       jobs: int = 1) -> list[dict]:
    """Each distinct build dispatch makes on each GPU (tools/dispatch.py), compiled and checked
    as run_audit checks the registry's, over `jobs` processes (compiling is single-threaded);
    results name the GPU and the cases asking for the build."""
    from cutebwd.tools import dispatch

    work = [(gpu.name, i) for gpu in dispatch.gpus(gpu_names)
            for i, build in enumerate(dispatch.distinct_builds(gpu)) if not only or only in build.name]
    if jobs <= 1 or len(work) <= 1:
        return _audit_dispatch_builds(work, keep_dir, progress)
    import multiprocessing

    # spawn: a forked copy of a process that has loaded the DSL's compiler is not safe to use
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        shares = pool.starmap(_audit_dispatch_builds, [(work[j::jobs], keep_dir) for j in range(jobs)])
    results = [None] * len(work)
    for j, share in enumerate(shares):
        results[j::jobs] = share
    return results


def _audit_dispatch_builds(work, keep_dir=None, progress=None) -> list[dict]:
    """The audit of builds (GPU name, index among its distinct builds); a worker of
    run_dispatch_audit reports its progress on stderr."""
    from cutebwd.tools.gpus import GPUS
    from cutebwd.tools import dispatch

    progress = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    nvdisasm = find_nvdisasm()
    builds = {name: list(dispatch.distinct_builds(GPUS[name]).items()) for name in dict.fromkeys(g for g, _ in work)}
    results = []
    for gpu_name, i in work:
        gpu, (build, cases) = GPUS[gpu_name], builds[gpu_name][i]
        progress(f"[dispatch audit] {gpu_name} {i + 1}/{len(builds[gpu_name])} {build.name} ...")
        result = {"kernel": build.name, "arch": gpu.arch, "gpu": gpu_name,
                  "cases": [f"{op} {case}" for op, case in cases]}
        try:
            result.update(audit_build(build.compile, gpu.arch, nvdisasm, keep_dir))
        except Exception as error:  # what a first call on that GPU would raise
            result.update(families={}, resources={}, launches=[],
                          violations=[f"does not compile: {type(error).__name__}: {error}"])
        else:
            result["violations"] = build_problems(result, build.expects)
        results.append(result)
    return results


def dispatch_summary(results: list[dict]) -> str:
    """Per GPU: how many distinct builds, for how many first-call requests, and how many failed."""
    lines = []
    for gpu in dict.fromkeys(r["gpu"] for r in results):
        mine = [r for r in results if r["gpu"] == gpu]
        failed = [r["kernel"] for r in mine if r["violations"]]
        lines.append(f"{gpu} ({mine[0]['arch']}): {len(mine)} distinct builds for "
                     f"{sum(len(r['cases']) for r in mine)} first-call requests, {len(failed)} failed"
                     + "".join(f"\n  FAIL {name}" for name in failed))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = tool_parser("audit", __doc__)
    parser.add_argument("--json", default="audit.json", help="where to write the full results (the whole table)")
    parser.add_argument("--only", help="audit only builds whose name contains this")
    parser.add_argument("--keep", help="keep PTX and CUBIN files under this folder")
    parser.add_argument("--table", action="store_true", help="also print the per-build table")
    parser.add_argument("--dispatch", action="store_true", help="audit what dispatch builds (tools/dispatch.py)")
    parser.add_argument("--gpu", action="append", help="with --dispatch: a GPU of tools/gpus.py (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="with --dispatch: processes compiling")
    args = parser.parse_args(argv)
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.only and not args.dispatch and not registered_builds(args.only):
        names = sorted({name for name, *_ in registered_builds()})
        print(f"--only {args.only!r} matches no build; the builds are:\n  " + "\n  ".join(names), file=sys.stderr)
        return 2
    if args.dispatch:
        results = run_dispatch_audit(args.gpu, args.only, args.keep, progress, args.jobs)
    else:
        results = run_audit(args.only, args.keep, progress)
    if not results:
        print(f"--only {args.only!r} matches no build", file=sys.stderr)
        return 2
    if args.table:
        print(format_table(results))
    print(summary(results))
    if args.dispatch:
        print(dispatch_summary(results))
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.json} (the per-build table)")
    return 1 if any(r["violations"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
