"""What a worker can read of its own machine. Every value it cannot read is None, never -1 or 0.

These figures are for operators only: no score uses them (DESIGN.md, design rule 2).
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil

from events.event import Resources

_nvml: Any = None
_nvml_tried = False


def _gpu() -> tuple[float | None, int | None, int | None]:
    """GPU utilisation and VRAM through NVML when the optional pynvml module and a GPU exist."""
    global _nvml, _nvml_tried
    if not _nvml_tried:
        _nvml_tried = True
        with contextlib.suppress(Exception):
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            _nvml = pynvml
    if _nvml is None:
        return None, None, None
    try:
        handle = _nvml.nvmlDeviceGetHandleByIndex(0)
        util = float(_nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        mem = _nvml.nvmlDeviceGetMemoryInfo(handle)
        return util, int(mem.used), int(mem.total)
    except Exception:
        return None, None, None


def read_resources() -> Resources:
    """CPU and memory from psutil, GPU from NVML where present; None wherever unreadable."""
    cpu: float | None = None
    used: int | None = None
    total: int | None = None
    with contextlib.suppress(Exception):
        cpu = float(psutil.cpu_percent(interval=None))
    with contextlib.suppress(Exception):
        vm = psutil.virtual_memory()
        used, total = int(vm.total - vm.available), int(vm.total)
    gpu, vram_used, vram_total = _gpu()
    return Resources(
        cpu_percent=cpu,
        mem_used_bytes=used,
        mem_total_bytes=total,
        gpu_percent=gpu,
        vram_used_bytes=vram_used,
        vram_total_bytes=vram_total,
    )
