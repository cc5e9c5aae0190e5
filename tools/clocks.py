"""The GPU's SM clock, board power and throttle reasons while timed work runs, read through
NVML (the driver's libnvidia-ml, by ctypes: no extra dependency).

Why the timings carry them: the H200 runs compute-bound work into its 700 W software power cap
(SM clock 1050-1980 MHz seen), so one kernel's time depends on what ran before it and on how
much power the work itself draws (in the bench's loops the decoder layer ran at 1425-1500 MHz
where cuBLAS's products ran at 1470-1815; docs/design-decoder-layer.md). A figure with its
clock says which state it was measured in.

    sample = clocks.sampled()
    with sample:
        ...timed loops...  (the same sample may be entered again: its windows add up)
    sample.summary()  # {"sm_mhz": ..., "sm_mhz_min": ..., "power_w": ..., "power_capped": ...}

A separate process reads the device every 10 ms for the whole run (started on first use,
~0.1 s), so no thread of the timed process wakes up during a loop (a host-bound loop's
figure should not depend on the sampler); each window keeps the samples stamped inside it.
Without NVML (no driver, CI) the summaries are empty.

    python -m cutebwd.tools.clocks [--uuid GPU-...] [--period 0.01]   # the samples as lines
"""
from __future__ import annotations

import atexit
import ctypes
import os
import statistics
import subprocess
import sys
import time

NVML_CLOCK_SM = 1
NVML_FI_DEV_POWER_INSTANT = 186  # nvmlDeviceGetPowerUsage is a 1 s average on Hopper: too slow for a loop
# nvmlClocksEventReasons bits that mean "held below the clock asked for by power"
SW_POWER_CAP, HW_POWER_BRAKE = 0x4, 0x80
PERIOD_S = 0.01


class _FieldValue(ctypes.Structure):  # nvmlFieldValue_t
    _fields_ = [("field_id", ctypes.c_uint), ("scope_id", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latency_us", ctypes.c_longlong), ("value_type", ctypes.c_int), ("status", ctypes.c_int),
                ("value", ctypes.c_ulonglong)]  # a union of 8 bytes; the power field is an unsigned int (mW)


class Device:
    """One GPU in NVML, by UUID (CUDA's and NVML's indices differ under CUDA_VISIBLE_DEVICES)
    or else by index; `open` gives None where NVML or the device is missing."""

    @classmethod
    def open(cls, uuid: str | None, index: int = 0):
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None
        handle = ctypes.c_void_p()
        if lib.nvmlInit_v2() != 0:
            return None
        if not (uuid and lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) == 0) \
                and lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            return None
        return cls(lib, handle)

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle

    def read(self) -> tuple[int, float, int] | None:
        """(SM clock MHz, board power W now, throttle-reason bits), or None if a query fails."""
        mhz, power, reasons = ctypes.c_uint(), _FieldValue(field_id=NVML_FI_DEV_POWER_INSTANT), ctypes.c_ulonglong()
        lib = self.lib
        if (lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(mhz))
                or lib.nvmlDeviceGetFieldValues(self.handle, 1, ctypes.byref(power)) or power.status
                or lib.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle, ctypes.byref(reasons))):
            return None
        return mhz.value, (power.value & 0xFFFFFFFF) / 1e3, reasons.value


def summarize(samples) -> dict:
    """{sm_mhz (median), sm_mhz_min, power_w (median), power_capped (fraction of samples held
    by the power cap or brake)} of (MHz, W, reasons) samples; {} for none."""
    if not samples:
        return {}
    mhz = [s[0] for s in samples]
    return {"sm_mhz": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "power_w": statistics.median(s[1] for s in samples),
            "power_capped": sum(1 for s in samples if s[2] & (SW_POWER_CAP | HW_POWER_BRAKE)) / len(samples)}


def describe(summary: dict) -> str:
    """'1755 MHz 690 W capped 80%' for a log line; '' without samples."""
    if not summary:
        return ""
    capped = summary["power_capped"]
    return f"{summary['sm_mhz']:.0f} MHz {summary['power_w']:.0f} W" + (f" capped {capped:.0%}" if capped else "")


class Monitor:
    """The sampling process and what it has written: lines 'time MHz W reasons', read without
    blocking whenever a window opens or closes, kept in `samples` for the whole run (~100 a
    second, a few MB an hour) so windows may overlap."""

    def __init__(self, uuid: str | None, index: int, period_s: float = PERIOD_S):
        command = [sys.executable, "-m", "cutebwd.tools.clocks", "--index", str(index), "--period", str(period_s)]
        self.process = subprocess.Popen(command + (["--uuid", uuid] if uuid else []), stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL)
        os.set_blocking(self.process.stdout.fileno(), False)
        self.pending = b""
        self.samples = []  # (time, MHz, W, reasons), in the order written
        atexit.register(self.close)

    def collect(self) -> int:
        """Reads what the process has written into `samples`; returns their count."""
        try:
            self.pending += self.process.stdout.read() or b""
        except (OSError, ValueError):
            return len(self.samples)
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            t, mhz, watts, reasons = line.split()
            self.samples.append((float(t), int(mhz), float(watts), int(reasons)))
        return len(self.samples)

    def close(self):
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()


class Window:
    """The samples a monitor stamps while `with` blocks on this object run."""

    def __init__(self, monitor):
        self.monitor, self.samples, self.opened, self.first = monitor, [], None, 0

    def __enter__(self):
        if self.monitor is not None:
            self.first = self.monitor.collect()  # samples read before this belong to earlier times
            self.opened = time.time()
        return self

    def __exit__(self, *exc):
        if self.monitor is not None:
            closed = time.time()
            self.monitor.collect()
            self.samples += [s[1:] for s in self.monitor.samples[self.first:] if self.opened <= s[0] <= closed]
        return False

    def summary(self) -> dict:
        return summarize(self.samples)


_monitor = None


def sampled(cuda_index: int | None = None) -> Window:
    """A window on the run's sampling process (started here on first use, for the current
    CUDA device); a window that never sees a sample where there is no GPU or NVML."""
    global _monitor
    if _monitor is None:
        import torch

        if not torch.cuda.is_available():
            return Window(None)  # (without NVML the process exits at once: its windows stay empty)
        index = torch.cuda.current_device() if cuda_index is None else cuda_index
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        _monitor = Monitor(f"GPU-{uuid}" if uuid else None, index)
        time.sleep(0.2)  # its start-up (interpreter, NVML), so the first window is sampled too
    return Window(_monitor)


def main(argv=None) -> int:
    from cutebwd.tools import tool_parser

    parser = tool_parser("clocks", "Print 'time MHz W reasons' lines for one GPU until stopped.")
    parser.add_argument("--uuid")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--period", type=float, default=PERIOD_S)
    args = parser.parse_args(argv)
    device = Device.open(args.uuid, args.index)
    if device is None:
        print("clocks: no NVML device here", file=sys.stderr)
        return 2
    try:
        while True:
            sample = device.read()
            if sample is not None:
                sys.stdout.write(f"{time.time():.4f} {sample[0]} {sample[1]:.1f} {sample[2]}\n")
                sys.stdout.flush()
            time.sleep(args.period)
    except (KeyboardInterrupt, BrokenPipeError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
