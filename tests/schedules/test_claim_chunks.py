"""Chunk claiming (schedules/claim_chunks.py): which loops are marked, what the rewrite
makes of them, and that the kernels give the same bits at every thread count."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import s_tir, te, tirx

from qtvm import bcq_a8_gemv, lut_gemv, ops, ops_dense, ops_gemm
from qtvm.formats import get_format
from schedules import claim_chunks, compile_kernel, schedule_kernel, tir_pipeline
from tests.kernels import AVX2, NB, a8_inputs, int8_rounded_reference

INT4 = get_format("int4-g128")
BCQ3 = get_format("bcq3-g128")

#: Every x86 rule whose parallel loop is claimed, on awkward shapes (K not a multiple of the
#: group, N not of the column block, so the last chunk is partial).
KERNELS = {
    "fp32_gemv": lambda: ops.qmatmul_func(INT4, 300, 200, NB),
    "a8_gemv": lambda: ops.qmatmul_a8_func(INT4, 300, 200, NB),
    "a8_gemm": lambda: ops.qmatmul_a8_gemm_func(INT4, 300, 200, NB, 4),
    "fp32_gemm": lambda: ops_gemm.qmatmul_gemm_func(INT4, 300, 200, NB),
    "dense": lambda: ops_dense.dense_func(1030, 520, NB),
    "lut_gemv": lambda: lut_gemv.lut_gemv_func(BCQ3, 256, 200, NB),
    "lut16_gemv": lambda: lut_gemv.lut16_gemv_func(BCQ3, 256, 200, NB),
    "lut16_a8_gemv": lambda: lut_gemv.lut16_a8_gemv_func(BCQ3, 256, 200, NB),
    "bcq_a8_gemv": lambda: bcq_a8_gemv.bcq_a8_gemv_func(BCQ3, 256, 200, NB),
}
AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
# vpermw / vpermb + vpdpbusd: compiled and lowered here, not run
TARGETS = {"lut16_a8_gemv": AVX512, "bcq_a8_gemv": tvm.target.Target({"kind": "llvm", "mcpu": "icelake-server"})}


def _lowered(func: tirx.PrimFunc, pipeline: str, target=AVX2) -> str:
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tirx.transform.BindTarget(target.with_host(target))(mod)
    lower, _, _ = tvm.tirx.get_tir_pipeline(pipeline)
    with target, tvm.transform.PassContext():
        return lower(mod).script()


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_rules_mark_their_column_loop_and_the_pipeline_rewrites_it(name):
    target = TARGETS.get(name, AVX2)
    func = schedule_kernel(KERNELS[name](), target)
    assert claim_chunks.ANNOTATION in func.script()
    claimed = _lowered(func, tir_pipeline(target), target)
    assert "chunk_claims" in claimed and claim_chunks.ANNOTATION not in claimed
    assert "chunk_claims" not in _lowered(func, "default", target)  # TVM's own pipeline: the static split


def _parallel_matmul(private_accumulator: bool) -> s_tir.Schedule:
    """y = x @ w, parallel over column chunks: the sum in a per-chunk cache copied to y, or
    reduced straight into y."""
    x, w = te.placeholder((4, 32), name="x"), te.placeholder((32, 64), name="w")
    k = te.reduce_axis((0, 32), name="k")
    y = te.compute((4, 64), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, w, y]))
    block = sch.get_sblock("y")
    if private_accumulator:  # "y" sums into y_global; the block "y_global" copies it to y
        sch.cache_write(block, 0, "global")
        i, j = sch.get_loops(sch.get_sblock("y_global"))
        jo, _ = sch.split(j, [None, 16])
        sch.reorder(jo, i)
        sch.parallel(jo)
        sch.compute_at(block, jo)
    else:
        i, j, _ = sch.get_loops(block)
        jo, _ = sch.split(j, [None, 16])
        sch.reorder(jo, i)
        sch.parallel(jo)
    return sch


def test_a_loop_accumulating_into_its_output_is_declined():
    """Two tasks running one chunk would both add into y: not idempotent, not marked."""
    sch = _parallel_matmul(private_accumulator=False)
    assert not claim_chunks.mark_output_loop(sch, "y")
    assert claim_chunks.ANNOTATION not in sch.mod.script()


def test_a_loop_with_a_per_chunk_accumulator_is_marked():
    sch = _parallel_matmul(private_accumulator=True)
    assert claim_chunks.mark_output_loop(sch, "y_global")


def test_a_serial_loop_is_not_marked():
    sch = _parallel_matmul(private_accumulator=True)
    inner = sch.get_loops(sch.get_sblock("y_global"))[-1]
    assert not claim_chunks.mark(sch, inner)


# -- every thread count, in a child process (TVM's pool is sized once, at its start) --------
THREADS = (1, 2, 3, 5)
REPEATS = 12
CHILD_KERNELS = ("a8_gemv", "fp32_gemv", "lut16_gemv", "fp32_gemm")
ROWS = {"fp32_gemm": 5}  # prefill: rows past the register tile of 4


def _child() -> None:
    """Run each kernel at every thread count REPEATS times; print, per kernel, whether every
    result equals the one-thread result bit for bit (NaN-filled outputs, so a skipped chunk
    shows) and the largest difference from numpy."""
    configure = tvm.get_global_func("runtime.config_threadpool")
    num_threads = tvm.get_global_func("runtime.NumThreads")
    rng = np.random.default_rng(3)
    report = {"pools": []}
    for name in CHILD_KERNELS:
        func = KERNELS[name]()
        lib = compile_kernel(func, AVX2)["main"]
        args, out_shape, want = _inputs(name, func, rng)
        results = []
        for threads in THREADS:
            configure(1, threads)
            report["pools"].append(num_threads())
            for _ in range(REPEATS):
                y = tvm.runtime.tensor(np.full(out_shape, np.nan, np.float32))
                lib(*args, y)
                results.append(y.numpy())
        first = results[0]
        report[name] = {"identical": all(np.array_equal(r, first) for r in results),
                        "err": float(np.abs(first - want).max() / np.abs(want).max())}
    print(json.dumps(report))


def _inputs(name, func, rng):
    """(kernel arguments but y, y's shape, numpy's result) for ROWS (default 2) rows of x."""
    k, n = int(func.attrs[ops.FORMAT_ATTR]["k"]), int(func.attrs[ops.FORMAT_ATTR]["n"])
    fmt, m = (BCQ3 if name == "lut16_gemv" else INT4), ROWS.get(name, 2)
    x = rng.standard_normal((m, k)).astype(np.float32)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    if name != "a8_gemv":
        return ([tvm.runtime.tensor(x)] + [tvm.runtime.tensor(a) for a in ops.blocked_arrays(qt, NB)], (m, n),
                x.astype(np.float64) @ qt.dequantize().astype(np.float64))
    return a8_inputs(AVX2, fmt, qt, x), (m, n), int8_rounded_reference(x, fmt, qt)


def test_every_thread_count_gives_the_same_bits():
    env = {**os.environ, "TVM_NUM_THREADS": str(max(THREADS))}
    code = "import tests.schedules.test_claim_chunks as t; t._child()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.pop("pools") == list(THREADS) * len(CHILD_KERNELS)
    for name, row in report.items():
        assert row["identical"], name
        assert row["err"] < 1e-5, (name, row["err"])
