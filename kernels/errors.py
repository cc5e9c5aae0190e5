"""Errors the device finds, reported to the host later, with no host synchronization.

An op that validates data on the GPU (the embedding backward's ids) writes what it found into
its device's error record: four int64 words in pinned host memory that kernels write through
its mapped address, [op code, smallest id, largest id, vocabulary size], op code 0 meaning no
error. The first error sticks until the host reads it. Every cutebwd op reads the record of
its device on entry (a plain memory read, no CUDA call) and raises the error it holds, clearing
it; `check_errors()` synchronizes first, so it sees every error of the work queued so far.

A record is found once the device has run the kernel that wrote it: a call made while the GPU
is still behind an erroneous one does not see it yet. No device-side trap is used, so the CUDA
context always survives.
"""
from __future__ import annotations

import ctypes

import torch

# op code -> the op's name, as the error names it
OPS = {1: "embedding_rmsnorm_backward"}
EMBEDDING = 1
WORDS = 4

_records: dict = {}  # device index -> _Record


class _Record:
    def __init__(self, device_index: int):
        from cuda.bindings import runtime as cudart

        self.host = torch.zeros(WORDS, dtype=torch.int64, pin_memory=True)
        error, pointer = cudart.cudaHostGetDevicePointer(self.host.data_ptr(), 0)
        if error != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostGetDevicePointer: {error!r} (the error record needs mapped pinned memory)")
        self.device = _DeviceView(int(pointer), device_index).as_tensor()
        self.code = ctypes.c_int64.from_address(self.host.data_ptr())
        self.index = device_index

    def take(self) -> ValueError:
        """The recorded error as a ValueError, clearing the record (its code is set)."""
        code, smallest, largest, vocab = self.host.tolist()
        self.code.value = 0
        return ValueError(
            f"{OPS.get(code, f'op {code}')}: an earlier call on cuda:{self.index} got input_ids from {smallest} to "
            f"{largest}, outside [0, {vocab}); it wrote nothing into the outputs passed to it (a table it allocated "
            "holds NaN). Reported at this later call; cutebwd.check_errors() reports such errors on demand")


class _DeviceView:
    """The record's mapped device address as a CUDA tensor (zero copy), for kernels and torch ops."""

    def __init__(self, pointer: int, device_index: int):
        self.__cuda_array_interface__ = {"shape": (WORDS,), "typestr": "<i8", "data": (pointer, False), "version": 3,
                                         "strides": None, "stream": None}
        self.index = device_index

    def as_tensor(self):
        with torch.cuda.device(self.index):
            return torch.as_tensor(self, device=f"cuda:{self.index}")


def record(device_index: int):
    """The device's error record as an int64 [4] CUDA tensor (made on first use: before any
    CUDA-graph capture, as an op's first call is)."""
    entry = _records.get(device_index)
    if entry is None:
        entry = _records[device_index] = _Record(device_index)
    return entry.device


def pending(device_index: int):
    """The device's recorded op code (a ctypes int64 over the pinned record, 0: no error): an
    op reads its .value first and calls raise_pending only when it is set."""
    record(device_index)
    return _records[device_index].code


def raise_pending(device_index: int) -> None:
    """Raises the error recorded for the device, if any: every op's first step (a dict lookup
    while no op has made a record, ~0.3 us once one has)."""
    if _records:
        entry = _records.get(device_index)
        if entry is not None and entry.code.value:
            raise entry.take()


def check_errors(device=None) -> None:
    """Synchronizes `device` (every device holding a record when None) and raises the first
    error its kernels recorded, clearing it."""
    if device is None:
        indices = sorted(_records)
    else:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":  # records are kept per CUDA device; another type would check the current one
            raise ValueError(f"check_errors: device: expected a CUDA device, got {device}")
        indices = [torch.cuda.current_device() if device.index is None else device.index]
    for index in indices:
        torch.cuda.synchronize(index)
        raise_pending(index)
