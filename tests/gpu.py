"""Shared by the GPU kernel tests: schedule through the GPU family's rules, run the
scheduled TIR on PoCL (OpenCL), check the same TIR's CUDA with ptxas."""
from __future__ import annotations

import numpy as np
import pytest
import tvm

from qtvm import ops
from qtvm.target import parse_target
from qtvm.testing import opencl, ptxas
from schedules import schedule_kernel

CUDA = {arch: parse_target(f"cuda -arch={arch}") for arch in ("sm_80", "sm_90")}
SM80 = CUDA["sm_80"]

needs_opencl = pytest.mark.skipif(not opencl.available(), reason="no OpenCL device (apt-get install pocl-opencl-icd, "
                                                                  "pip install pyopencl)")
needs_nvcc = pytest.mark.skipif(not ptxas.available(), reason="no nvcc (CUDA toolkit)")


def scheduled(func: tvm.tirx.PrimFunc, target: tvm.target.Target = SM80) -> tvm.tirx.PrimFunc:
    return schedule_kernel(func, target)


def run_on_pocl(func: tvm.tirx.PrimFunc, x: np.ndarray, arrays, n: int, **build) -> np.ndarray:
    """func(x, *arrays, y) on PoCL; y starts as NaN so unwritten outputs fail checks."""
    y = np.full((x.shape[0], n), np.nan, np.float32)
    opencl.build(func, **build).run(np.ascontiguousarray(x, np.float32), *arrays, y)
    return y


def rel_err(got, want) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check_ptxas(funcs: dict[str, tvm.tirx.PrimFunc], archs=tuple(CUDA)) -> dict[str, dict[str, ptxas.KernelResources]]:
    """All ``funcs`` (name -> scheduled PrimFunc) as one CUDA module per arch (TVM's source for
    that arch), compiled for each arch side by side; every kernel fits (registers, shared
    memory) and nothing spills. Returns arch -> kernel name -> resources."""
    archs = (archs,) if isinstance(archs, str) else tuple(archs)
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    found = ptxas.ptxas_check_archs({arch: ptxas.cuda_source(mod, CUDA[arch]) for arch in archs})
    reports = {}
    for arch, kernels in found.items():
        report = reports[arch] = {k.name: k for k in kernels}
        assert {name.rsplit("_kernel", 1)[0] for name in report} >= set(funcs), (arch, sorted(report))
        for kernel in report.values():
            assert kernel.arch == arch and kernel.spill_bytes == 0 and kernel.stack_bytes == 0, kernel
            assert kernel.registers <= 255 and kernel.shared_bytes <= 48 * 1024, kernel
    return reports


def blocked(qt) -> list[np.ndarray]:
    return ops.blocked_arrays(qt, 1)
