"""What the benchmarks share: the machine record and the min / median / max of repeated runs."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from memtune.machine import describe


def machine() -> dict[str, Any]:
    """memtune.machine's record (CPU, the flags that switch kernels, versions), plus the CPUs
    this process may use and the memory."""
    return {
        **describe(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3,
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def loadavg() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None
