"""The on-disk layer of the compile cache: a TVM-FFI build exported as an object file once, so a
new process loads it (~2 ms) instead of compiling it again (1-3 s a build); and an audited
build's PTX, CUBIN and host code (what tools/audit.py reads of it), so the audit and its tests
compile each build once per source version.

A file's name is a digest of the build's key, its arch, the DSL's version and switches
(CUTE_DSL_*) and the source of every kernel and layout module of this package, so an edit to
any of them, or a new DSL, reads as a miss: the cache never hands back code from other
sources. Files live in one folder per source digest; the KEEP_VERSIONS newest are kept. Files are written to a temporary
name and renamed, so processes sharing the cache never read half a file.

Where: $CUTEBWD_CACHE_DIR, else $XDG_CACHE_HOME/cutebwd, else ~/.cache/cutebwd;
CUTEBWD_CACHE_DIR=off turns the layer off (the in-process cache stays).
"""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import tempfile
import types
import warnings
import zlib
from pathlib import Path

ENV = "CUTEBWD_CACHE_DIR"
_PACKAGE = Path(__file__).resolve().parents[1]


def directory() -> Path | None:
    """The cache directory, or None when the layer is off."""
    if os.environ.get(ENV, "").lower() in ("off", "0", "none"):
        return None
    return user_directory()


def user_directory() -> Path:
    """The folder the cache lives in whether or not the layer is on ($CUTEBWD_CACHE_DIR where it
    names one, else $XDG_CACHE_HOME or ~/.cache, then cutebwd): the user's other files (the
    tuner's table) go there too."""
    value = os.environ.get(ENV, "")
    if value and value.lower() not in ("off", "0", "none"):
        return Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cutebwd"


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """A digest of what decides the generated code beside a build's key: the DSL's version
    and the source of this package's kernels and layouts."""
    from importlib.metadata import version

    digest = hashlib.sha256(version("nvidia-cutlass-dsl").encode())
    # the DSL's own switches (CUTE_DSL_*) can change what it generates
    digest.update(repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL"))).encode())
    for folder in ("kernels", "layouts"):
        for path in sorted((_PACKAGE / folder).rglob("*.py")):
            digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def entry_name(key, arch: str) -> str | None:
    """The file stem (also the exported function's name) of a build, or None when its key
    has no stable text (an object shown by address would differ in every process)."""
    text = repr((key, arch))
    if " at 0x" in text:
        return None
    return "cutebwd_" + hashlib.sha256((code_digest() + text).encode()).hexdigest()[:32]


def path_of(name: str, suffix: str = ".o") -> Path | None:
    root = directory()
    return None if root is None else root / code_digest() / f"{name}{suffix}"


def load(name: str):
    """The exported function `name` as a tvm_ffi.Function, or None when it is not on disk
    (or cannot be read: then it is compiled again and rewritten)."""
    path = path_of(name)
    if path is None or not path.exists():
        return None
    from cutlass.cute.runtime import load_module

    try:
        return getattr(load_module(str(path), enable_tvm_ffi=True), name)
    except Exception as error:  # a truncated or foreign file: fall back to compiling
        warnings.warn(f"cutebwd: compile cache entry {path} unreadable ({error}); compiling again")
        return None


KEEP_VERSIONS = 4  # code digests kept side by side (a branch switch need not recompile)


def _prune(root: Path) -> None:
    """Deletes all but the KEEP_VERSIONS most recently written code-digest folders."""
    import shutil

    folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in folders[KEEP_VERSIONS:]:
        shutil.rmtree(old, ignore_errors=True)


def store(name: str, compiled) -> None:
    """Exports a TVM-FFI build under `name`."""
    _write(path_of(name), lambda temporary: compiled.export_to_c(temporary, name))


class Dumped:
    """An audited build read back from disk: what the audit reads of a compiled one."""

    def __init__(self, cubin: bytes, ptx: str, host: str):
        self.artifacts = types.SimpleNamespace(CUBIN=cubin, PTX=ptx)
        self.ir_module = host


def load_dumps(name: str, dump_dir: str) -> Dumped | None:
    """The audited build `name` (also written into `dump_dir`, where the audit keeps its files),
    or None when it is not on disk or cannot be read."""
    path = path_of(name, ".dumps")
    if path is None or not path.exists():
        return None
    try:
        fields = json.loads(zlib.decompress(path.read_bytes()))
        dumped = Dumped(base64.b64decode(fields["cubin"]), fields["ptx"], fields["host"])
    except Exception as error:
        warnings.warn(f"cutebwd: compile cache entry {path} unreadable ({error}); compiling again")
        return None
    os.makedirs(dump_dir, exist_ok=True)
    Path(dump_dir, f"{name}.cubin").write_bytes(dumped.artifacts.CUBIN)
    Path(dump_dir, f"{name}.ptx").write_text(dumped.artifacts.PTX)
    return dumped


def store_dumps(name: str, compiled) -> None:
    """Keeps a build compiled with dumps: its CUBIN, PTX and lowered host code."""
    fields = {"cubin": base64.b64encode(compiled.artifacts.CUBIN).decode(), "ptx": compiled.artifacts.PTX,
              "host": str(compiled.ir_module)}
    blob = zlib.compress(json.dumps(fields).encode())
    _write(path_of(name, ".dumps"), lambda temporary: Path(temporary).write_bytes(blob))


def _write(path: Path | None, write) -> None:
    """`write(temporary path)`, then the file renamed into place, so processes sharing the cache
    never read half a file. A cache that cannot be written costs only the next process's
    compile time, so failures warn and go on."""
    if path is None:
        return
    try:
        if not path.parent.exists():  # a new code version: make room for it
            path.parent.mkdir(parents=True)
            _prune(path.parent.parent)
        handle, temporary = tempfile.mkstemp(suffix=path.suffix, dir=path.parent)
        os.close(handle)
        try:
            write(temporary)
            os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide it from a cache shared between users
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except Exception as error:
        warnings.warn(f"cutebwd: could not write the compile cache at {path.parent} ({error})")
