"""The installed layout: one namespace `cutebwd`, public ops at its top."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import cutebwd


def test_subpackages_live_under_cutebwd():
    for sub in ("kernels", "layouts", "references", "tools"):
        assert importlib.import_module(f"cutebwd.{sub}").__name__ == f"cutebwd.{sub}"


def _setuptools_table() -> dict:
    """pyproject.toml's [tool.setuptools]."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the package supports 3.10
    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_only_cutebwd_is_installed_at_the_top():
    """Hugging Face's `kernels` owns that top-level name; we install nothing beside `cutebwd`."""
    setuptools = _setuptools_table()
    assert setuptools["package-dir"] == {"cutebwd": "."}
    assert all(p == "cutebwd" or p.startswith("cutebwd.") for p in setuptools["packages"])


def test_every_folder_the_package_reads_is_listed():
    """A folder of code or data left out of `packages` is missing from a non-editable install
    (setuptools warns "package would be ignored" and drops it)."""
    listed = set(_setuptools_table()["packages"])
    root = Path(__file__).parents[1]
    for top in ("kernels", "layouts", "references", "tools"):
        for folder in [root / top, *(p for p in (root / top).rglob("*") if p.is_dir())]:
            if folder.name != "__pycache__" and any(f.suffix in (".py", ".json") for f in folder.iterdir()):
                assert "cutebwd." + ".".join(folder.relative_to(root).parts) in listed, folder


def test_the_checkouts_folders_are_not_top_level_modules_under_the_tools():
    """Run at the checkout's root (`python -m`, `-c`: the working directory on sys.path), the
    tools and tests leave `kernels` to Hugging Face's package, not this checkout's folder."""
    root = Path(__file__).parents[1].resolve()
    code = ("import importlib.util, cutebwd.tools; spec = importlib.util.find_spec('kernels'); "
            "print(spec.origin if spec else '')")
    found = subprocess.run([sys.executable, "-c", code], cwd=root, check=True, capture_output=True, text=True)
    assert not found.stdout.strip().startswith(str(root / "kernels")), found.stdout


def test_public_ops_resolve():
    for name in cutebwd.__all__:
        assert callable(getattr(cutebwd, name))


def test_dir_lists_the_ops_and_a_version_exists():
    assert set(cutebwd.__all__) <= set(dir(cutebwd))
    assert isinstance(cutebwd.__version__, str) and cutebwd.__version__


def test_the_namespace_holds_nothing_borrowed():
    """Public names are the ops and the subpackages: no helper the package imported for itself
    (`cutebwd.version` would read as ours)."""
    public = {name for name in dir(cutebwd) if not name.startswith("_")}
    assert public - set(cutebwd.__all__) <= {"kernels", "layouts", "references", "tools"}, public


def test_no_error_recorded_means_nothing_to_raise():
    # Without a record (no op has run on a device) every op's entry check is a dict lookup.
    from cutebwd.kernels import errors

    if not errors._records:
        errors.raise_pending(0)
    assert callable(cutebwd.check_errors) and "check_errors" in dir(cutebwd)


def test_check_errors_names_a_device_that_is_not_cuda():
    with pytest.raises(ValueError, match="expected a CUDA device, got cpu"):
        cutebwd.check_errors("cpu")
