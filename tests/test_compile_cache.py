"""The on-disk compile cache: a second process loads what the first compiled, keys that differ
(or code that changed) miss, an unreadable entry is compiled again, and loaded builds compute
what compiled ones do."""
import json
import os
import subprocess
import sys

import pytest

from cutebwd.kernels import disk_cache, runtime
from cutebwd.kernels.id_sort import build_range_and_keys
from cutlass import Int32, Int64

# the registry's quickest builds (~0.1 s each to compile)
QUICK = "ids range and int16 keys"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.ENV, str(tmp_path))
    monkeypatch.setattr(runtime, "_compiled", {})  # no in-process hits
    return tmp_path


def test_a_second_process_loads_what_the_first_compiled(cache):
    command = [sys.executable, "-m", "cutebwd.tools.compile_cache", "--only", QUICK, "--json", "-"]
    runs = [json.loads(subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout)
            for _ in range(2)]
    assert [r["how"] for r in runs[0]] == ["compiled"] and [r["how"] for r in runs[1]] == ["loaded"]
    # any digest folder: this process's digest is cached, the sources may change under a long run
    assert len(list(cache.glob("*/cutebwd_*.o"))) == 1


def test_entry_names_follow_key_arch_and_code(monkeypatch):
    name = disk_cache.entry_name(("087 range and keys", "Int64"), "sm_90a")
    assert name.isidentifier() and name.startswith("cutebwd_")
    assert name != disk_cache.entry_name(("087 range and keys", "Int32"), "sm_90a")
    assert name != disk_cache.entry_name(("087 range and keys", "Int64"), "sm_100a")
    monkeypatch.setattr(disk_cache, "code_digest", lambda: "edited source")
    assert name != disk_cache.entry_name(("087 range and keys", "Int64"), "sm_90a")


def test_audited_builds_are_read_back_as_the_audit_reads_them(cache, tmp_path_factory):
    """A build compiled with dumps (the audit's) is kept on disk: compiled again in a fresh process,
    it comes back with the same CUBIN, PTX and host code, and its files in the new dump folder."""
    from cutebwd.tools import audit

    nvdisasm = audit.find_nvdisasm()
    first = audit.audit_build(lambda arch, dump_dir: build_range_and_keys(Int64, arch, dump_dir), "sm_90a", nvdisasm)
    runtime._compiled.clear()
    again = tmp_path_factory.mktemp("dumps")
    dumped = build_range_and_keys(Int64, "sm_90a", str(again))
    assert isinstance(dumped, disk_cache.Dumped) and len(list(again.glob("*.cubin"))) == 1
    runtime._compiled.clear()
    second = audit.audit_build(lambda arch, dump_dir: build_range_and_keys(Int64, arch, dump_dir), "sm_90a", nvdisasm)
    assert {k: v for k, v in first.items() if k != "compile_s"} == {k: v for k, v in second.items() if k != "compile_s"}


def test_keys_without_stable_text_stay_off_disk():
    assert disk_cache.entry_name(("kernel", object()), "sm_90a") is None


def test_off_switch(cache, monkeypatch):
    monkeypatch.setenv(disk_cache.ENV, "off")
    assert disk_cache.directory() is None
    build_range_and_keys(Int64, "sm_90a")
    assert not any(cache.iterdir())


def test_an_unreadable_entry_is_compiled_again(cache):
    build_range_and_keys(Int32, "sm_90a")
    (entry,) = cache.glob("*/cutebwd_*.o")
    entry.write_bytes(b"not an object file")
    runtime._compiled.clear()
    with pytest.warns(UserWarning, match="unreadable"):
        compiled = build_range_and_keys(Int32, "sm_90a")
    assert not isinstance(compiled, runtime.Loaded) and entry.stat().st_size > 1000  # rewritten
    runtime._compiled.clear()
    assert isinstance(build_range_and_keys(Int32, "sm_90a"), runtime.Loaded)


# The same calls (013, 087 on two paths, a GEMM) in two processes sharing one fresh cache: the
# first compiles and writes, the second loads every build it uses from disk; both are right.
_CALL = """
import json, torch
from cutebwd import fused_residual_rmsnorm_backward, embedding_rmsnorm_backward
from cutebwd.kernels import runtime
from cutebwd.references import PROBLEMS
from cutebwd.tools.parity import check_problem
ok = all(report.ok for name, op, seq in (("fused_residual_rmsnorm_backward", fused_residual_rmsnorm_backward, 300),
                                         ("embedding_rmsnorm_backward", embedding_rmsnorm_backward, 300),
                                         ("embedding_rmsnorm_backward", embedding_rmsnorm_backward, 3000))
         for report in check_problem(PROBLEMS[name], op, 2, seq, seed=5))
from cutebwd.kernels.gemm import matmul_nt
a, b = torch.randn(300, 512, device="cuda").bfloat16(), torch.randn(264, 512, device="cuda").bfloat16()
ok &= torch.allclose(matmul_nt(a, b).float(), a.float() @ b.float().T, rtol=2e-2, atol=2e-2)
print(json.dumps({"ok": ok, "loaded": [isinstance(c, runtime.Loaded) for c in runtime._compiled.values()]}))
"""


@pytest.mark.gpu
def test_loaded_builds_compute_what_compiled_ones_do(tmp_path):
    env = {**os.environ, disk_cache.ENV: str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CALL], env=env, check=True, stdout=subprocess.PIPE,
                                      text=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["ok"] and runs[1]["ok"]
    assert not any(runs[0]["loaded"]) and runs[1]["loaded"] and all(runs[1]["loaded"])


def test_old_code_versions_are_pruned(cache, monkeypatch):
    for i in range(disk_cache.KEEP_VERSIONS + 2):
        old = cache / f"version{i}"
        old.mkdir()
        os.utime(old, (i, i))  # older first
    build_range_and_keys(Int64, "sm_90a")
    kept = sorted(p.name for p in cache.iterdir())
    assert disk_cache.code_digest() in kept and len(kept) == disk_cache.KEEP_VERSIONS
    assert "version0" not in kept and f"version{disk_cache.KEEP_VERSIONS + 1}" in kept
