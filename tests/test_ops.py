"""Compute definitions + x86 rules against the numpy references of their formats."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm import ops
from qtvm.formats import get_format
from tests.kernels import AVX2, ISA_TARGETS, NB, RUNNABLE, int8_rounded_reference, rel_err, run_a8, run_blocked
from tests.kernels import compile_scheduled as build



@pytest.mark.parametrize("preset,k,n", [
    ("int4-g128", 1000, 37), ("int4-g32", 128, 1), ("int4-g64", 4096, 37), ("int4-col", 1000, 37),
    ("int3-g128", 1000, 37), ("int2-g64", 300, 70), ("int8-g32", 256, 65), ("int4-g128-f16", 1000, 37),
    ("int3-g64-f16-qz", 300, 70),
])
def test_qmatmul_fp32_activations(preset, k, n):
    fmt = get_format(preset)
    rng = np.random.default_rng(k + n)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    lib = build(ops.qmatmul_func(fmt, k, n, NB), AVX2)
    for m in (1, 17):  # one compiled kernel, symbolic M
        x = rng.standard_normal((m, k)).astype(np.float32)
        assert rel_err(run_blocked(lib, x, qt), x.astype(np.float64) @ qt.dequantize()) < 1e-5


def test_kernel_carries_format_description():
    func = ops.qmatmul_func(get_format("int3-g128"), 1000, 37, NB)
    desc = func.attrs[ops.FORMAT_ATTR]
    assert func.attrs[ops.KERNEL_ATTR] == "qmatmul"
    assert (int(desc["bits"]), int(desc["group"]), int(desc["padded_k"]), int(desc["col_block"])) == (3, 128, 1024, 64)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("preset,k,n", [("int4-g128", 1000, 37), ("int4-g32", 4096, 1), ("int2-g64", 300, 70),
                                        ("e0m4-g128", 1000, 37), ("e0m4-g64-f16", 300, 70), ("int4-g128-qz", 1000, 37),
                                        ("int3-g128", 1000, 37), ("int3-g32", 4096, 1), ("int3-g64-qz", 300, 70),
                                        ("int4-g128-f16", 1000, 37)])
def test_qmatmul_int8_activations(isa, preset, k, n):
    fmt = get_format(preset)
    rng = np.random.default_rng(k)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    for m in (1, 17):
        x = rng.standard_normal((m, k)).astype(np.float32)
        got, _ = run_a8(ISA_TARGETS[isa], fmt, qt, x)
        # Exactly x_hat @ W_hat (int32 dots are exact) ...
        assert rel_err(got, int8_rounded_reference(x, fmt, qt)) < 1e-5
        # ... and within int8 rounding of the fp32 result, on the scale of |x| |w_col|
        # (per-value rounding is at most amax/254 per 32-block).
        w = qt.dequantize().astype(np.float64)
        scale = np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(w, axis=0)[None, :]
        assert float((np.abs(got - x.astype(np.float64) @ w) / scale).max()) < 0.01


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("preset,k,n", [("int4-g128", 1000, 37), ("int3-g64", 300, 70), ("int2-g32", 4096, 1),
                                        ("e0m4-g128", 1000, 37), ("int4-g64-f16", 1000, 37)])
def test_qmatmul_int8_activations_prefill(isa, preset, k, n):
    """Row tiles of 4: M = 1, 4, 5 and 18 (tails of 1..3 padding rows)."""
    fmt = get_format(preset)
    rng = np.random.default_rng(k + 1)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    for m in (1, 4, 5, 18):
        x = rng.standard_normal((m, k)).astype(np.float32)
        got, _ = run_a8(ISA_TARGETS[isa], fmt, qt, x, row_tile=4)
        assert rel_err(got, int8_rounded_reference(x, fmt, qt)) < 1e-5


def test_host_can_run_avx2_path():
    assert "avx2" in RUNNABLE  # every supported x86 host; the AVX-512 variants run where the CPU has them


@pytest.mark.parametrize("preset", ["int4-g128", "int3-g128", "int2-g64"])
@pytest.mark.parametrize("isa,pattern,register", [
    ("avx512vnni", ["vpdpbusd"], "zmm"), ("avx512bw", ["vpmaddubsw", "vpmaddwd"], "zmm"),
    ("avxvnni", ["{vex}", "vpdpbusd"], "ymm"), ("avx2", ["vpmaddubsw", "vpmaddwd"], "ymm")])
def test_int8_dot_asm(preset, isa, pattern, register):
    """The byte-dot intrinsic lands as its instruction on full-width registers, no scalar extracts."""
    fmt = get_format(preset)
    asm = build(ops.qmatmul_a8_func(fmt, 4096, 256, NB), ISA_TARGETS[isa]).mod.inspect_source("asm")
    lines = asm.splitlines()
    for instr in pattern:
        assert any(instr in line and register in line for line in lines), instr
    assert "vpextrd" not in asm and "vpextrb" not in asm
    assert "prefetcht1" in asm  # the weight stream is prefetched ahead, into L2
    # unpack: vector shifts (GFNI targets: affine ops) and masks of whole code words (VNNI
    # int4: masks only, the high nibbles' dot shifted back once per block by an arithmetic shift)
    assert any(("vpsrld" in line or "vpsrad" in line or "vgf2p8affineqb" in line) and register in line
               for line in lines)
    assert any("vpand" in line and register in line for line in lines)


@pytest.mark.parametrize("isa,instr,register", [("avx512vnni", "vpdpbusd", "zmm"), ("avx512bw", "vpmaddubsw", "zmm"),
                                                 ("avx2", "vpmaddubsw", "ymm")])
def test_int8_prefill_asm_keeps_the_tile_in_registers(isa, instr, register):
    """The row-tiled kernel: byte dots on full registers, and no store of an accumulator
    between two dots (each weight unit is unpacked once and used for all rows)."""
    func = ops.qmatmul_a8_gemm_func(get_format("int4-g128"), 4096, 256, NB, 4)
    lines = build(func, ISA_TARGETS[isa]).mod.inspect_source("asm").splitlines()
    dots = [i for i, line in enumerate(lines) if instr in line and register in line]
    assert len(dots) >= 32
    first, last = dots[0], dots[31]  # one call: 8 units x 4 rows (x vectors)
    stores = [i for i in range(first, last) if "vmovdq" in lines[i] and "(%r" in lines[i].split(",")[-1]]
    # a spilled int16 partial (AVX-512BW with claimed chunks: one, measured no slower) is not an
    # int32 accumulator: the last writer of a stored register must not be an int32 sum
    accumulating = [_last_writer(lines, i) for i in stores]
    assert not [w for w in accumulating if w.split()[0] in ("vpdpbusd", "vpaddd", "vpmaddwd")], accumulating[:3]


def _last_writer(lines: list[str], store: int) -> str:
    """The last instruction before line ``store`` whose destination is the stored register."""
    reg = lines[store].split()[1].rstrip(",")
    return next(line.strip() for line in reversed(lines[:store])
                if line.strip() and not line.strip().startswith(("vmovdq", ".", "#")) and line.rstrip().endswith(reg))


def test_fp32_unpack_asm_avx512():
    """fp32 path built for AVX-512: vector shifts/converts/FMAs on zmm."""
    asm = build(ops.qmatmul_func(get_format("int4-g128"), 4096, 256, NB), ISA_TARGETS["avx512bw"]).mod.inspect_source("asm")
    lines = asm.splitlines()
    for instr in ("vpsrld", "vcvtdq2ps", "vfmadd"):
        assert any(instr in line and ("zmm" in line or "ymm" in line) for line in lines), instr
    assert sum("zmm" in line for line in lines) > 50


def test_unsupported_formats_keep_fp32_activations():
    assert ops.supports_int8_activations(get_format("int4-g128"), 1000)
    assert ops.supports_int8_activations(get_format("e0m4-g128"), 1000)  # affine in its 4-bit code
    assert not ops.supports_int8_activations(get_format("bcq3-g128"), 1000)
    assert ops.supports_int8_activations(get_format("int3-g128"), 1000)  # re-laid in byte planes
    assert not ops.supports_int8_activations(get_format("int8-g128"), 1000)
    assert not ops.supports_int8_activations(get_format("int4-g16"), 1000)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("preset,k,n", [("int4-g128", 1000, 37), ("int3-g64", 300, 70), ("int2-g32", 128, 1),
                                        ("e0m4-g32", 200, 70), ("int4-g32-f16-qz", 200, 64)])
def test_int8_routed_experts_round_each_row_and_read_its_expert(isa, preset, k, n):
    """The int8 routed kernel (the int8 GEMV with each row's expert bound in its row loop): row
    i is exactly x_hat[i] @ W_hat[ids[i]] (x rounded per 32 values), M = 1 and more rows than
    experts, K off the group, N off the vector width, negative ids from the end."""
    import tvm

    from schedules import schedule_kernel

    fmt, experts = get_format(preset), 3
    rng = np.random.default_rng(k + n)
    tensors = [fmt.quantize(rng.standard_normal((k, n)).astype(np.float32)) for _ in range(experts)]
    func = ops.qmatmul_a8_expert_func(fmt, k, n, NB, experts)
    assert [str(p) for p in schedule_kernel(func, ISA_TARGETS[isa]).params][1:2] == ["ids"]  # expert: bound, not passed
    lib = build(func, ISA_TARGETS[isa])
    weights = [tvm.runtime.tensor(a) for a in ops.expert_arrays(tensors, NB, int8=True)]
    for m in (1, 7):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ids = rng.integers(-experts, experts, m).astype(np.int64)
        want = np.concatenate([int8_rounded_reference(x[i:i + 1], fmt, tensors[ids[i]]) for i in range(m)])
        y = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(ids), *weights, y)
        assert rel_err(y.numpy(), want) < 1e-5, m


@pytest.mark.parametrize("preset,k,n", [("int4-g128", 1000, 37), ("int3-g64", 300, 70), ("int2-g32", 128, 1),
                                        ("int8-g32", 256, 65), ("e0m4-g32", 200, 70), ("bcq3-g128", 300, 70),
                                        ("int4-g32-f16-qz", 200, 64)])
def test_qmatmul_experts_multiplies_each_row_by_its_expert(preset, k, n):
    """A mixture of experts' routed matmul: row i by expert ids[i]'s weight, every format family,
    M = 1 and more rows than experts, K off the group, N off the column block; a negative id
    counts from the end (ONNX Gather's), as numpy's indexing does."""
    import tvm

    fmt, experts = get_format(preset), 3
    rng = np.random.default_rng(k + n)
    tensors = [fmt.quantize(rng.standard_normal((k, n)).astype(np.float32)) for _ in range(experts)]
    lib = build(ops.qmatmul_experts_func(fmt, k, n, NB, experts), AVX2)
    weights = [tvm.runtime.tensor(a) for a in ops.expert_arrays(tensors, NB)]
    for m in (1, 7):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ids = rng.integers(-experts, experts, m).astype(np.int64)
        want = np.stack([x[i].astype(np.float64) @ tensors[ids[i]].dequantize() for i in range(m)])
        y = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(ids), *weights, y)
        assert rel_err(y.numpy(), want) < 1e-5, m
