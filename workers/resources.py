"""What a worker can read of its own machine. Every value it cannot read is None, never -1 or 0.

These figures are for operators only: no score uses them (DESIGN.md, design rule 2).
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil

from events.event import Resources
from workers.backend import Inventory

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


def max_loaded(inventory: Inventory, resources: Resources) -> int | None:
    """How many of the held models fit in the machine's memory at once, smallest first; None when
    a size or the memory is unknown.

    The memory is the GPU's when the worker can read it (a backend keeps models there), else the
    machine's. A model's size is what the backend reported for it loaded (/api/ps: weights and
    context), else its file size; a machine that cannot keep even its two smallest models together
    has room for one at a time, so that loading one evicts the other. This is a fact the plan uses
    (router.plan), not a load figure: it never ranks a worker.
    """
    memory = resources.vram_total_bytes or resources.mem_total_bytes
    if not memory or not inventory.models:
        return None
    # By digest: two names of one model are one model in memory.
    sizes: dict[str, int] = {}
    for m in inventory.models:
        size = inventory.loaded_bytes.get(m.digest, m.size)
        if not size:
            return None
        sizes[m.digest] = size
    fits, used = 0, 0
    for size in sorted(sizes.values()):
        if used + size > memory:
            break
        fits, used = fits + 1, used + size
    return max(1, fits)
