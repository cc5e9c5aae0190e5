"""What dispatch reads off a GPU: the arch its builds are compiled for and the SM count its
tiling rules and schedules count with.

At run time both come from the device (kernels.runtime.device_gpu); compiling without one (the
audit, CPU tests) they come from the GPUs below, so what is checked there is what the GPU's
first call builds.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    arch: str  # the CuTe DSL target: "sm_90a", "sm_100a", "sm_103a"
    sms: int


H200 = Gpu("H200", "sm_90a", 132)
B200 = Gpu("B200", "sm_100a", 148)
GPUS = {gpu.name: gpu for gpu in (H200, B200)}
