"""ptxas reports parsed per kernel; TVM's CUDA source compiled for both architectures."""
from __future__ import annotations

import pytest

from qtvm.errors import QtvmError
from qtvm.testing import ptxas
from tests.gpu import needs_nvcc
from tests.testing.test_opencl import two_stage

REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'main_kernel' for 'sm_90'
ptxas info    : Function properties for main_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 24576 bytes smem
ptxas info    : Compiling entry function 'main_kernel_1' for 'sm_90'
ptxas info    : Function properties for main_kernel_1
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
"""


def test_parse():
    first, second = ptxas.parse_ptxas(REPORT)
    assert (first.name, first.arch, first.registers, first.shared_bytes, first.spill_bytes) == \
        ("main_kernel", "sm_90", 64, 24576, 0)
    assert (second.registers, second.shared_bytes, second.stack_bytes, second.spill_bytes) == (40, 0, 8, 12)


@needs_nvcc
def test_tvm_cuda_source_compiles():
    from qtvm.target import parse_target

    archs = ("sm_80", "sm_90")
    sources = {arch: ptxas.cuda_source(two_stage(), parse_target(f"cuda -arch={arch}")) for arch in archs}
    found = ptxas.ptxas_check_archs(sources)  # both nvcc runs at once
    assert sorted(found) == sorted(archs)
    for arch, kernels in found.items():
        assert sorted(k.name for k in kernels) == ["main_kernel", "main_kernel_1"]
        assert all(k.arch == arch for k in kernels)
    assert ptxas.ptxas_check(sources["sm_80"], "sm_80") == found["sm_80"]  # one arch alone: the same


@needs_nvcc
def test_compile_error_is_one_line():
    with pytest.raises(QtvmError, match="nvcc could not compile"):
        ptxas.ptxas_check("this is not CUDA", "sm_80")
