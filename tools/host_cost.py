"""What a call costs the host, in pieces: a TVM-FFI call of a compiled host function
that makes 1, 2 or 4 launches of a trivial kernel (with and without programmatic dependent
launch), the torch allocation calls an op makes for its outputs, and PyTorch's own
`Tensor.copy_` beside them, all in one process with `timing.host_us` (tight loop, no sync).

    python -m cutebwd.tools.host_cost [--json host-cost.json]

Read with an op's own host time (tools.bench's "host us"): on the H200 it measured ~4.3 us a
launch and the call itself well under 1 us, so an op's launches, not its FFI call, set its
floor (docs/design-host.md).
"""
from __future__ import annotations

import sys

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32

from cutebwd.kernels import runtime
from cutebwd.tools import timing, tool_parser

LAUNCHES = ((1, False), (2, False), (4, False), (4, True))


class Launches:
    """A compiled host function making `count` launches of a one-warp kernel that adds 1 to x[0]."""

    def __init__(self, count: int, pdl: bool):
        self.count, self.pdl = count, pdl

    @cute.jit
    def __call__(self, x: cute.Tensor, stream):
        for _ in cutlass.range_constexpr(self.count):
            self.kernel(x).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, x: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            x[0] = x[0] + 1.0


def build(count: int, pdl: bool, arch: str):
    return runtime.compile_kernel(("host_cost_launches", count, pdl), Launches(count, pdl),
                                  runtime.fake_tensor(Float32, (16,), (1,), 16), runtime.env_stream(), arch=arch,
                                  tvm_ffi=True)


def measure() -> dict:
    arch = runtime.device_arch(torch.cuda.current_device())
    x = torch.zeros(16, device="cuda")
    like = torch.empty((4096, 640), dtype=torch.bfloat16, device="cuda")
    rows = {}
    for count, pdl in LAUNCHES:
        run = runtime.ffi_function(build(count, pdl, arch))
        rows[f"FFI call, {count} launch{'es' if count > 1 else ''}{' (PDL)' if pdl else ''}"] = \
            timing.host_us(run, [(x,)])
        timing.progress(f"[host_cost] {count} launches, pdl {pdl}")
    device = like.device
    rows["torch.empty(shape, dtype=, device=)"] = timing.host_us(
        lambda: torch.empty((4096, 640), dtype=torch.bfloat16, device=device), [()])
    rows["Tensor.new_empty(shape)"] = timing.host_us(lambda: like.new_empty((4096, 640)), [()])
    rows["torch.empty_like(t)"] = timing.host_us(lambda: torch.empty_like(like), [()])
    rows["Tensor.copy_ (1 MB)"] = timing.copy_host_us()
    return rows


def main(argv=None) -> int:
    parser = tool_parser("host_cost", __doc__)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not timing.have_gpu("host_cost"):
        return 2
    rows = measure()
    for name, us in rows.items():
        print(f"{name:40s} {us:7.2f} us")
    timing.write_results(args.json, host_us=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
