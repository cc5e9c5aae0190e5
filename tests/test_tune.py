"""The tuner's table: bucket keys, the dispatch lookup, the committed tables' validity, and on
the GPU that matmul_nt takes the table's pick."""
import json

import pytest

from cutebwd.kernels.gemm import GemmCall
from cutebwd.kernels.runtime import ARCHES
from cutebwd.layouts import gemm as layouts
from cutebwd.layouts.gemm import GemmTiling, default_tiling, shape_bucket, tuned_table, tuned_tiling
from cutebwd.tools.gpus import H200
from cutebwd.tools import tune
from cutebwd.tools.parity import relative_error


def test_buckets_round_token_dimensions_up_and_keep_n():
    assert shape_bucket(128, 5120, 5120, True, False) == "128x5120x8192 km"
    assert shape_bucket(129, 5120, 5120, True, False) == "256x5120x8192 km"
    assert shape_bucket(1, 640, 8192, False, False) == "64x640x8192 mm"
    assert shape_bucket(8192, 640, 1536, True, True) != shape_bucket(8192, 640, 1536, False, True)


@pytest.fixture
def table(tmp_path, monkeypatch):
    entries = {shape_bucket(128, 5120, 5120, True, False): {"tiling": "128x64"},
               shape_bucket(5120, 5120, 128, False, False): {"tiling": "128x128c2x1p", "default": "128x128c2x1p"}}
    (tmp_path / "sm_90a.json").write_text(json.dumps({"arch": "sm_90a", "entries": entries}))
    monkeypatch.setattr(layouts, "TUNED_DIR", tmp_path)
    monkeypatch.setenv(layouts.USER_TUNED_ENV, str(tmp_path / "user"))
    tuned_table.cache_clear()
    yield
    tuned_table.cache_clear()


def test_a_users_table_is_read_before_the_shipped_one(table, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    bucket = shape_bucket(128, 5120, 5120, True, False)
    (user / "sm_90a.json").write_text(json.dumps({"arch": "sm_90a", "entries": {bucket: {"tiling": "64x128"}}}))
    tuned_table.cache_clear()
    assert tuned_tiling(100, 5120, 5000, True, False, "sm_90a") == GemmTiling.from_spec("64x128")
    assert layouts.user_tuned_dir() == user


def test_the_tuner_writes_outside_the_package(monkeypatch, tmp_path):
    monkeypatch.delenv(layouts.USER_TUNED_ENV, raising=False)
    monkeypatch.delenv("CUTEBWD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert layouts.user_tuned_dir() == tmp_path / "cutebwd" / "tuned"
    assert layouts.TUNED_DIR not in layouts.user_tuned_dir().parents
    monkeypatch.setenv("CUTEBWD_CACHE_DIR", str(tmp_path / "cache"))  # beside the compile cache
    assert layouts.user_tuned_dir() == tmp_path / "cache" / "tuned"


def test_dispatch_reads_the_table_for_its_bucket_only(table):
    assert tuned_tiling(100, 5120, 5000, True, False, "sm_90a") == GemmTiling.from_spec("128x64")
    assert tuned_tiling(100, 5120, 5000, True, True, "sm_90a") is None  # other majors
    assert tuned_tiling(300, 5120, 5000, True, False, "sm_90a") is None  # another M bucket
    assert tuned_tiling(100, 5120, 5000, True, False, "sm_100a") is None  # no table for the arch
    # where the tuner kept the rules' pick of its day, today's rules decide
    assert tuned_tiling(5120, 5120, 128, False, False, "sm_90a") is None


def test_a_group_takes_the_pick_for_its_stacked_bucket(table):
    def stacked(ms, n, k, a_k_major, b_k_major):
        return GemmCall(sum(ms), n, k, a_k_major, b_k_major, products=len(ms)).tiling_on(H200)

    # three products of 40, 30 and 30 rows stack to 100: the 128-row bucket's pick
    assert stacked((40, 30, 30), 5120, 5000, True, False) == GemmTiling.from_spec("128x64")
    # where the tuner kept its day's rule, today's rules decide (K = 128: 128-column store pieces)
    assert stacked((2560, 2560), 5120, 128, False, False) == default_tiling(5120, 5120, 128, H200)
    assert stacked((2560, 2560), 5120, 128, False, False).epilogue_n == 128


@pytest.mark.parametrize("arch", ARCHES)
def test_committed_tables_hold_runnable_tilings_under_their_own_keys(arch, monkeypatch, tmp_path):
    monkeypatch.setenv(layouts.USER_TUNED_ENV, str(tmp_path))  # the shipped table alone
    tuned_table.cache_clear()
    for bucket, entry in tuned_table(arch).items():
        m, n, k = entry["shape"]
        majors = bucket.split()[1]
        assert bucket == shape_bucket(m, n, k, majors[0] == "k", majors[1] == "k")
        assert tune.runnable(entry["tiling"], arch) is not None, (bucket, entry["tiling"])


def test_candidates_an_arch_cannot_run_are_skipped():
    assert tune.runnable("128x128c2x1p", "sm_90a") is not None
    assert tune.runnable("128x128c2x1p", "sm_100a") is None  # pingpong is Hopper's
    assert all(tune.runnable(spec, "sm_90a") for spec in tune.CANDIDATES)


@pytest.mark.gpu
def test_matmul_takes_the_tables_pick(table, monkeypatch):
    import torch

    from cutebwd.kernels.gemm import dispatch as gemm

    picked = []
    choose = gemm.choose_tiling
    # the table's pick reaches choose_tiling as `tuned` (a tiling asked for would come first)
    monkeypatch.setattr(gemm, "choose_tiling", lambda tiling, *rest, **options: picked.append(
        tiling or options.get("tuned")) or choose(tiling, *rest, **options))
    a = torch.randn(100, 5000, device="cuda").bfloat16()
    w = torch.randn(5000, 5120, device="cuda").bfloat16()  # b = w.t(): [5120, 5000], M-major
    out = gemm.matmul_nt(a, w.t())
    assert picked == [GemmTiling.from_spec("128x64")]
    expected = a.float() @ w.float()
    assert relative_error(out, expected) < 1e-2


def test_token_counts_from_the_workloads():
    counts = tune.token_counts("workloads")
    assert counts == sorted(set(counts)) and 128 in counts and 8192 in counts and 541 * 16 in counts
    assert tune.token_counts("128,512") == [128, 512]
