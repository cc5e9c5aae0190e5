"""rms_rstd, the foundation's small kernel: argument errors on any machine, parity on the GPU."""
import pytest
import torch

from cutebwd.kernels.row_rstd import rms_rstd
from cutebwd.tools.parity import assert_parity, poisoned_like


def reference_rstd(x, eps):
    """fp32, or float64 for the exact evaluation."""
    x = x if x.dtype == torch.float64 else x.float()
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def test_rejects_wrong_dtype():
    with pytest.raises(TypeError, match="x: expected dtype"):
        rms_rstd(torch.zeros(4, 64, dtype=torch.float64))


def test_rejects_cpu_tensor():
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        rms_rstd(torch.zeros(4, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2560), (131, 2560), (3, 211, 4096), (1000, 1024), (7, 8)])
def test_matches_reference(shape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(hash((shape, str(dtype))) % 2**31)
    x = (torch.randn(shape, device="cuda", generator=gen) * 3 + 0.5).to(dtype)
    eps = 1e-6
    out = poisoned_like(torch.empty(shape[:-1], device="cuda"))
    result = rms_rstd(x, eps, out=out)
    assert result is out
    assert_parity(["rstd"], [out], [reference_rstd(x, eps)], 1e-6, [reference_rstd(x.double(), eps)],
                  f"shape={shape} {dtype}")


@pytest.mark.gpu
def test_one_compile_serves_every_row_count():
    from cutebwd.kernels import runtime

    x = torch.randn(64, 2560, device="cuda")
    rms_rstd(x)
    before = len(runtime._compiled)
    for rows in (1, 5, 777, 4096):
        rms_rstd(torch.randn(rows, 2560, device="cuda"))
    assert len(runtime._compiled) == before


@pytest.mark.gpu
def test_gpu_argument_errors():
    x = torch.randn(4, 2560, device="cuda")
    with pytest.raises(ValueError, match="contiguous"):
        rms_rstd(x.t())
    with pytest.raises(ValueError, match="multiple of"):
        rms_rstd(torch.randn(4, 2562, device="cuda"))
    with pytest.raises(ValueError, match="aligned"):
        rms_rstd(torch.randn(4 * 2560 + 1, device="cuda")[1:].view(4, 2560))
    with pytest.raises(ValueError, match="out: expected shape"):
        rms_rstd(x, out=torch.empty(5, device="cuda"))
