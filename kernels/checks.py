"""Argument checks at the public boundary: every message names the argument and what was expected.

Kernels assume valid input; these checks are what stands between a caller's mistake and a
memory fault or silently wrong numbers.
"""
from __future__ import annotations

import torch


def check_tensor(name: str, t, *, dtypes, ndim: int | None = None, shape=None,
                 contiguous: bool = True, align: int = 16) -> None:
    """Raise TypeError/ValueError unless `t` is a CUDA tensor of one of `dtypes`, with the given
    rank/shape (None entries in `shape` match any extent), contiguous, and `align`-byte aligned."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {str(t.dtype).removeprefix('torch.')}")
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != e for s, e in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}"
                         " (call .contiguous() if a copy is acceptable)")
    if t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned for vector loads")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device: {listing}")


def check_tma_rows(name: str, t) -> None:
    """A [rows, cols] tensor a TMA tile copy reads or writes in place: row-major, with a row
    stride that is a multiple of 16 bytes."""
    if t.numel() and (t.stride(1) != 1 or t.stride(0) % (16 // t.element_size())):
        raise ValueError(f"{name}: expected row-major with a 16-byte multiple row stride (TMA), "
                         f"got strides {t.stride()}")


def check_row_strides(name: str, t, vector: int) -> None:
    """A [b, s, H] tensor the row kernels can read in place: contiguous last dimension and
    batch/seq strides that are multiples of `vector` elements (vector-aligned row starts)."""
    if t.stride(2) != 1 or t.stride(0) % vector or t.stride(1) % vector:
        raise ValueError(f"{name}: needs a contiguous last dimension and batch/seq strides that are "
                         f"multiples of {vector}, got strides {t.stride()}")


def check_hidden_size(name: str, hidden: int, limit: int) -> None:
    if hidden % 8 or not 0 < hidden <= limit:
        raise ValueError(f"{name}: hidden size must be a positive multiple of 8 up to {limit}, got {hidden}")


def check_module_tensors(op: str, tensors: dict, anchor: str) -> None:
    """The tensors of an autograd function's call (name -> tensor): bf16 torch tensors, all on
    the device of the one named `anchor` (any device: on CPU the function runs its reference)."""
    device = tensors[anchor].device if isinstance(tensors[anchor], torch.Tensor) else None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{op}: {name}: expected bfloat16, got {str(t.dtype).removeprefix('torch.')}")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, {anchor} on {device}")
