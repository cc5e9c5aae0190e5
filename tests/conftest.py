"""GPU tests carry @pytest.mark.gpu and skip cleanly where no CUDA device is present."""
import pytest

from cutebwd.tools import drop_checkout_root

drop_checkout_root()  # `python -m pytest` at the root would shadow transformers' `kernels`


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
