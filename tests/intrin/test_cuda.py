"""CUDA unpack TensorIntrins: the lop3 / prmt / 0x6400 / exponent-OR constants checked
bit-exactly (numpy emulation of the device code), the tensorized kernels through ptxas,
and the desc (the plain decode the intrinsic replaces) on PoCL."""
from __future__ import annotations

import numpy as np
import pytest
from tvm import s_tir, te

from qtvm.formats.uniform import UniformFormat
from qtvm.intrin import cuda as intrin
from tests.gpu import CUDA, check_ptxas, needs_nvcc, needs_opencl


def reference(kind: str, runs: np.ndarray) -> np.ndarray:
    """[count, words] int32 runs -> [count, values] decoded values (float64)."""
    words, values, bits = intrin.RUNS[kind]
    if kind == "u3":
        codes = UniformFormat(3, None).unpack(np.ascontiguousarray(runs.T), 32).T
    else:
        u = runs[:, 0].view(np.uint32)
        codes = np.stack([(u >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1) for j in range(values)], 1)
    codes = codes.astype(np.float64)
    return 1 + codes / 16 if kind == "e0m4" else codes


def runs_for(kind: str, count: int = 4096) -> np.ndarray:
    words, values, bits = intrin.RUNS[kind]
    rng = np.random.default_rng(len(kind) + bits)
    runs = rng.integers(0, 2 ** 32, (count, words), dtype=np.uint64).astype(np.uint32)
    if words == 1:  # and every code in every position
        for code in range(1 << bits):
            runs[code, 0] = sum(code << (bits * j) for j in range(values)) & 0xFFFFFFFF
    return runs.view(np.int32)


@pytest.mark.parametrize("kind", list(intrin.RUNS))
def test_bit_tricks_decode_exactly(kind):
    runs = runs_for(kind)
    np.testing.assert_array_equal(intrin.emulate(kind, runs).astype(np.float64), reference(kind, runs))


def test_systematic_names_are_registered():
    assert intrin.intrin_name("u4") == "qtvm_unpack_u4_f16x8_cuda"
    assert intrin.intrin_name("u3") == "qtvm_unpack_u3_f16x32_cuda"
    for kind in intrin.RUNS:
        s_tir.TensorIntrin.get(intrin.intrin_name(kind))


def unpack_kernel(kind: str, n: int = 64, runs: int = 4, tensorize: bool = True, intrinsics=intrin):
    """O[n, runs * values] = decode(W[n, runs * words]): one thread per column; each run
    tensorized with the unpack intrinsic of ``intrinsics`` (``qtvm.intrin.cuda`` or ``.opencl``)."""
    words, values, _ = intrin.RUNS[kind]
    w = te.placeholder((n, runs * words, 1), "int32", name="W")  # column-blocked, one column a block
    o = te.compute((n, runs * values),
                   lambda j, k: intrin.unpack_value(kind, lambda r: w[j, (k // values) * words + r, 0], k % values),
                   name="O")
    sch = s_tir.Schedule(te.create_prim_func([w, o]))
    block = sch.get_sblock("O")
    j, k = sch.get_loops(block)
    run, value = sch.split(k, [None, values])
    jo, ji = sch.split(j, [None, 32])
    sch.bind(jo, "blockIdx.x")
    sch.bind(ji, "threadIdx.x")
    sch.compute_at(sch.cache_read(block, 0, "local"), run)
    sch.reverse_compute_at(sch.cache_write(block, 0, "local"), run)
    if tensorize:
        sch.tensorize(value, intrinsics.intrin_name(kind))
    return sch.mod["main"]


@needs_nvcc
def test_tensorized_unpack_compiles_without_spills():
    from qtvm.testing.ptxas import cuda_source

    funcs = {f"unpack_{kind}": unpack_kernel(kind) for kind in intrin.RUNS}
    for target in CUDA.values():
        assert "lop3.b32" in cuda_source(funcs["unpack_u4"], target)
        assert "__byte_perm" in cuda_source(funcs["unpack_u8"], target)
    check_ptxas(funcs)  # sm_80 and sm_90


@needs_opencl
@pytest.mark.parametrize("kind", ["u4", "u3", "e0m4"])
def test_desc_decode_on_opencl(kind):
    from qtvm.testing import opencl

    words, values, _ = intrin.RUNS[kind]
    runs = runs_for(kind, 256)  # 64 columns x 4 runs
    w = runs.reshape(64, 4 * words, 1)
    out = np.full((64, 4 * values), np.nan, np.float16)
    opencl.build(unpack_kernel(kind, tensorize=False), half_as_float=True).run(w, out)  # values exact either way
    np.testing.assert_array_equal(out.astype(np.float64).reshape(256, values), reference(kind, runs))
