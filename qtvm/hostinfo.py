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


def _processor_fields(cpuinfo: str | None = None) -> list[dict[str, str]] | None:
    """The fields of each processor block of /proc/cpuinfo (or of ``cpuinfo``); None where it
    cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    return [{k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}
            for block in cpuinfo.strip().split("\n\n")]


def cpu_identity(cpuinfo: str | None = None) -> str:
    """Vendor, family, model and stepping of the first CPU: a VM's model name can be as vague as
    'Intel(R) Xeon(R) Processor' for two generations, so a measurement records these too."""
    fields = (_processor_fields(cpuinfo) or [{}])[0]
    return (f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')} stepping {fields.get('stepping', '?')}")


def physical_cores(cpuinfo: str | None = None, allowed: set[int] | None = None) -> int:
    """Physical cores among the CPUs this process may run on.

    TVM's default thread count is half the logical CPUs on x86 (it assumes two
    hyperthreads a core), which on a VM with one thread a core, like a 2-vCPU
    cloud machine, leaves half the cores idle.
    """
    import os

    if allowed is None:
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    blocks = _processor_fields(cpuinfo)
    if blocks is None:
        return max(1, len(allowed))
    cores = set()
    for fields in blocks:
        if "processor" not in fields or int(fields["processor"]) not in allowed:
            continue
        cores.add((fields.get("physical id", "0"), fields.get("core id", fields["processor"])))
    return max(1, len(cores)) if cores else max(1, len(allowed))
