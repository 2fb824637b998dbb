"""OpenCL unpack TensorIntrins (``as_half2`` magic exponents, E0M4's exponent OR): the
tensorized kernels run on PoCL with every code in every position. PoCL has no
cl_khr_fp16, so the harness reads ``as_half2``'s bits with ``vload_half2`` (bit-exact) and
spells the rest of the kernel's halves as floats: this checks the constants, shifts and
which value lands where; the subtract of 1024 is exact in fp16 as in fp32."""
from __future__ import annotations

import numpy as np
import pytest
from tvm import s_tir

from qtvm.intrin import opencl as intrin
from qtvm.intrin.runs import RUNS
from tests.gpu import needs_opencl
from tests.intrin.test_cuda import reference, runs_for, unpack_kernel


def test_systematic_names_are_registered():
    assert intrin.intrin_name("u4") == "qtvm_unpack_u4_f16x8_opencl"
    assert intrin.intrin_name("e0m4") == "qtvm_unpack_e0m4_f16x8_opencl"
    for kind in intrin.KINDS:
        s_tir.TensorIntrin.get(intrin.intrin_name(kind))


@needs_opencl
@pytest.mark.parametrize("kind", list(RUNS))
def test_tensorized_unpack_decodes_exactly_on_opencl(kind):
    from qtvm.testing import opencl

    words, values, _ = RUNS[kind]
    runs = runs_for(kind, 256)  # 64 columns x 4 runs
    func = unpack_kernel(kind, intrinsics=intrin)
    program = opencl.build(func, half_as_float=True)
    assert "qtvm_as_half2(" in program.source  # the intrinsic's as_half2, read through vload_half2
    out = np.full((64, 4 * values), np.nan, np.float16)
    program.run(runs.reshape(64, 4 * words, 1), out)
    np.testing.assert_array_equal(out.astype(np.float64).reshape(256, values), reference(kind, runs))


def test_source_is_the_exponent_trick():
    """E0M4: one OR of the shifted codes into the exponent of 1.0, no subtract (Transformer-Lite);
    int4: the 0x6400 magic exponent, one half2 subtract of 1024."""
    from qtvm.target import parse_target
    from qtvm.testing.opencl import lower
    from tvm.tirx.build import codegen_build

    def source(kind):
        _, device_mod, device_target = lower(unpack_kernel(kind, intrinsics=intrin), parse_target("opencl -device=mali"))
        return codegen_build(device_mod, device_target).inspect_source()

    e0m4 = source("e0m4")
    assert e0m4.count("as_half2(") == 4 and "1006648320" in e0m4 and "1.024" not in e0m4  # 0x3C003C00
    u4 = source("u4")
    assert u4.count("as_half2(") == 4 and "1677747200" in u4 and "1.024000e+03" in u4  # 0x64006400
