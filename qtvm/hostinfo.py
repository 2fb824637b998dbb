"""Facts about the machine we run on; no TVM import (the thin runtime uses it)."""
from __future__ import annotations


def host_cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where it is unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
