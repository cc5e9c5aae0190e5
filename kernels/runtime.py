"""How host code meets CuTe DSL: target arch, compile (cached in process and on disk), arguments, stream.

Two calling conventions:
- TVM-FFI (`compile_kernel(..., tvm_ffi=True)` with `fake_tensor` arguments and `env_stream()`):
  the compiled function takes torch tensors directly. Argument decoding, dtype/shape/stride/
  alignment/device checks and the launch all happen in C (a few us per call instead of the
  DSL's ~100 us Python marshalling), on torch's current stream. Hot-path ops use this.
- Raw pointers (`gmem_ptr`, `fake_ptr`) plus Int32 extents and a `CUstream`: no extra
  dependency, slower per call; kept for small utility kernels.
Both compile from fake arguments on a machine with no GPU.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Hashable

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_ptr, nullptr
from cutlass.cute.typing import AddressSpace

from ..layouts.gpus import Gpu
from . import disk_cache

# Compute capability -> the CuTe DSL target built for it. An `a` target's cubin loads only on its
# exact capability (sm_100a code does not run on a B300, 10.3), so each GPU gets its own.
ARCH_OF_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
ARCHES = tuple(ARCH_OF_CAPABILITY.values())

_compiled: dict[Hashable, Any] = {}


@functools.lru_cache(maxsize=None)
def device_gpu(device_index: int) -> Gpu:
    """A CUDA device's arch and SM count, what dispatch reads off it; a GPU no target is built
    for, or one offering a CTA less shared memory than its arch's builds assume
    (layouts.gpus.SMEM_PER_BLOCK), raises RuntimeError naming it."""
    props = torch.cuda.get_device_properties(device_index)
    arch = ARCH_OF_CAPABILITY.get((props.major, props.minor))
    if arch is None:
        supported = ", ".join(f"{major}.{minor} ({target})" for (major, minor), target in ARCH_OF_CAPABILITY.items())
        raise RuntimeError(f"cutebwd kernels are built for compute capabilities {supported}; device {device_index}, "
                           f"{props.name}, is {props.major}.{props.minor}")
    gpu = Gpu(props.name, arch, props.multi_processor_count)
    offered = getattr(props, "shared_memory_per_block_optin", gpu.smem_per_block)  # torch >= 2.4 has it
    if offered < gpu.smem_per_block:
        raise RuntimeError(f"device {device_index}, {props.name}, offers {offered} bytes of shared memory a CTA; "
                           f"the {arch} builds need {gpu.smem_per_block}")
    return gpu


def device_arch(device_index: int) -> str:
    """The CuTe DSL arch string for a CUDA device (device_gpu)."""
    return device_gpu(device_index).arch


def compile_kernel(key: Hashable, jit_fn: Callable, *args, arch: str, dump_dir: str | None = None,
                   tvm_ffi: bool = False):
    """Compile `jit_fn(*args)` for `arch` once per `key`; with `dump_dir`, keep PTX and CUBIN there.

    `key` must name everything that changes the generated code (kernel, config, static dims,
    dtypes) and show the same text in every process (it names the on-disk entry); dynamic
    extents (batch, sequence) are runtime arguments and stay out of it. With `tvm_ffi`, the
    result is called with torch tensors (see the module docstring) and a new process loads it
    from disk (kernels/disk_cache.py) instead of compiling it again; a build with `dump_dir`
    (the audit's) is read back from disk as its CUBIN, PTX and host code (disk_cache.Dumped).
    """
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    full_key = (key, arch, dump_dir, tvm_ffi)
    hit = _compiled.get(full_key)
    if hit is not None:
        return hit
    # On disk too: TVM-FFI builds as loadable objects, the audit's (dump_dir) as what it reads.
    if dump_dir is None:
        on_disk = disk_cache.entry_name(key, arch) if tvm_ffi else None
        loaded = disk_cache.load(on_disk) if on_disk else None
        compiled = Loaded(loaded) if loaded is not None else None
    else:
        on_disk = disk_cache.entry_name((key, "dumps", tvm_ffi), arch)
        compiled = disk_cache.load_dumps(on_disk, dump_dir) if on_disk else None
    if compiled is None:
        options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm_ffi else "")
        if dump_dir is not None:
            os.makedirs(dump_dir, exist_ok=True)
            options += f" --keep-cubin --keep-ptx --dump-dir {dump_dir}"
        compiled = cute.compile(jit_fn, *args, options=options)
        if on_disk:
            (disk_cache.store if dump_dir is None else disk_cache.store_dumps)(on_disk, compiled)
    _compiled[full_key] = compiled
    return compiled


class Loaded:
    """A TVM-FFI build read back from the on-disk cache: only its positional entry point."""

    def __init__(self, function):
        self.function = function

    def __tvm_ffi_object__(self):
        return self.function


def gmem_ptr(tensor, dtype, align: int = 16):
    """A global-memory CuTe pointer to a torch tensor's storage (zero copy)."""
    return make_ptr(dtype, tensor.data_ptr(), AddressSpace.gmem, assumed_align=align)


def fake_ptr(dtype, align: int = 16):
    """A null global-memory pointer, for compiling without a GPU."""
    return nullptr(dtype, AddressSpace.gmem, assumed_align=align)


def ffi_function(compiled):
    """The positional C entry point of a TVM-FFI build. The DSL's wrapper object adds a Python
    keyword-argument layer (several us per call); hot paths call this instead. The stream
    argument is not part of it: TVM-FFI takes torch's current stream."""
    return compiled.__tvm_ffi_object__()


class PerStream:
    """What `_new` makes, once per CUDA stream, reused call after call.

    Calls on one stream run in order, so they never overlap on it; another stream gets its
    own. Under CUDA-graph capture a set comes from the graph's pool, so replays own their
    memory and never race eager calls: a graph's calls on one stream share a set as eager calls
    do (they replay in the same order); a call from another stream or capture makes a new one.
    """

    def __init__(self, device):
        self.device, self.device_index = device, device.index
        self._buffers = {}  # raw CUDA stream handle -> what _new made
        self._captured = (None, None)  # ((stream, capture sequence), its set) of the latest capture

    def _new(self, *need):
        raise NotImplementedError

    def _fits(self, buffer, *need) -> bool:
        """Whether `buffer` serves a call needing `need` (asked only where a call states one)."""
        return True

    def get(self, *need):
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        # CUDA never captures the legacy default stream (raw handle 0), so an eager call there
        # skips the capture query (~0.3-0.5 us of a ~1.3 us lookup; docs/design-host.md);
        # torch.cuda.is_current_stream_capturing's own call, without its Python frame.
        if stream and torch._C._cuda_isCurrentStreamCapturing():
            return self._for_capture(stream, *need)
        buffer = self._buffers.get(stream)
        if buffer is None or need and not self._fits(buffer, *need):
            buffer = self._buffers[stream] = self._new(*need)
        return buffer

    def _for_capture(self, stream, *need):
        """The set of `stream`'s capture sequence. A fresh set in every captured call put a fill
        kernel (the zeroed counters) in each: the QKV backward's graph replay took 10.49 against
        9.15 us a call at 2 x 128 (H200). Only the latest (stream, capture sequence)'s set is
        held, so calls alternating between two streams of one capture each make a new one (as
        before); a dropped set goes back to its graph's pool, which the graph keeps until it is
        destroyed."""
        key = (stream, capture_sequence(stream))
        held, buffer = self._captured
        if held != key or not self._fits(buffer, *need):
            buffer = self._new(*need)
            self._captured = (key, buffer)
        return buffer


def capture_sequence(stream: int) -> int:
    """The id of the capture sequence the capturing CUDA stream `stream` (a raw handle) is in,
    unique over the process's lifetime (cudaStreamGetCaptureInfo)."""
    from cuda.bindings import runtime as cudart

    error, _, sequence = cudart.cudaStreamGetCaptureInfo(cudart.cudaStream_t(stream))[:3]
    if error != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaStreamGetCaptureInfo: {error!r}")
    return int(sequence)


class StreamWorkspace(PerStream):
    """A scratch fp32 [rows, cols] buffer per CUDA stream (subclasses add what else they keep)."""

    def __init__(self, rows: int, cols: int, device):
        super().__init__(device)
        self.shape = (rows, cols)

    def _new(self):
        return torch.empty(self.shape, dtype=torch.float32, device=self.device)


def zero_fill(tensor):
    """Zeroes a contiguous CUDA tensor by cudaMemsetAsync on torch's current stream and returns
    it. On the H200 it writes the embedding backward's 512 MB table at 4.5 TB/s; torch's fill
    kernel (torch.zeros, zero_) reaches 3.4 (docs/design-embedding.md)."""
    from cuda.bindings import runtime as cudart

    if not tensor.is_contiguous():
        raise ValueError("zero_fill: expected a contiguous tensor")
    stream = torch.cuda.current_stream(tensor.device).cuda_stream
    (error,) = cudart.cudaMemsetAsync(tensor.data_ptr(), 0, tensor.numel() * tensor.element_size(), stream)
    if error != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaMemsetAsync: {error!r}")
    return tensor


def fake_tensor(dtype, shape, stride, align: int):
    """A compile-time stand-in for a global-memory tensor: ints are static (checked at each call),
    `cute.sym_int*()` objects dynamic; one SymInt object used twice must match at each call."""
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def env_stream():
    """Stream argument of a TVM-FFI build: the launch uses torch's current stream of the call."""
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream(use_tvm_ffi_env_stream=True)


def current_stream(device):
    """The current torch CUDA stream of `device` as the driver handle kernels launch on."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def fake_stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(0)


TORCH_TO_CUTE = {}


def cute_dtype(torch_dtype):
    """The CuTe numeric type of a torch dtype (only those the kernels take)."""
    if not TORCH_TO_CUTE:
        TORCH_TO_CUTE.update({
            torch.bfloat16: cutlass.BFloat16,
            torch.float16: cutlass.Float16,
            torch.float32: cutlass.Float32,
            torch.int32: cutlass.Int32,
            torch.int64: cutlass.Int64,
        })
    return TORCH_TO_CUTE[torch_dtype]


def max_clusters(device, size: int) -> int:
    """How many clusters of `size` one-CTA-per-SM CTAs the GPU holds at once: SMs / size only
    where every GPC's SM count divides evenly, so ask the driver."""
    if size == 1:
        return torch.cuda.get_device_properties(device).multi_processor_count
    with torch.cuda.device(device):
        # The driver query needs this thread's context current; a capturing stream proves it
        # is (and must not be synchronized: a shape's first call may come inside a capture).
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return cutlass.utils.HardwareInfo().get_max_active_clusters(size)
