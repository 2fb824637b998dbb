"""GPU MetaSchedule pieces that run without a GPU: the design space (analytic first,
sampled candidates that schedule and compile without spills), the L2 rotation, and the
runner saying clearly that it timed nothing (no device)."""
from __future__ import annotations

import pytest
import tvm
from tvm import s_tir

from qtvm import lut_gemv, ops
from qtvm.formats import get_format
from schedules import facts, gpu_tune, schedule_kernel
from tests.gpu import SM80, check_ptxas, needs_nvcc


def gemv(k=4096, n=512):
    fmt = get_format("int4-g128")
    return ops.qmatmul_func(fmt, k, n, 1, **facts(SM80).gemv_options(fmt, k))


def test_analytic_knobs_reproduce_the_rule():
    func = gemv()
    space = gpu_tune.GpuKnobSpace.of(func, SM80)
    assert {name: values[0] for name, values in space.knobs.items()} == space.analytic
    tuned = space.schedule(func, space.analytic).mod["main"]
    sch = s_tir.Schedule(tuned)
    block = sch.get(sch.get_sblock(ops.BLOCK_OUT))
    assert {str(k): int(v) for k, v in block.annotations.items()} == \
        {gpu_tune.KNOB_PREFIX + k: v for k, v in space.analytic.items()}
    # the same loops as the rule's schedule (annotations aside), vector loads of x included
    rule = schedule_kernel(func, SM80).script()
    for loop in ("thread_binding", "T.vectorized"):
        assert tuned.script().count(loop) == rule.count(loop), loop
    assert rule.count("T.vectorized") >= 1  # the 32-byte activation loads (a lane's weights: one word)


def test_sampled_decisions_are_read_back_from_the_trace():
    for f in (gemv(1024, 256), lut_gemv.lut_gemv_func(get_format("bcq3-g128"), 1024, 256, 1)):
        space = gpu_tune.GpuKnobSpace.of(f, SM80)
        for seed in (1, 2, 3):
            sch = s_tir.Schedule(f, seed=seed)
            chosen = space.apply(sch)
            assert gpu_tune.trace_knobs(sch.trace) == chosen
            assert all(chosen[k] in v for k, v in space.knobs.items())


@needs_nvcc
def test_candidates_compile_without_spills():
    """The analytic point and a far corner of each space, as the builder would build them."""
    func, lut = gemv(1024, 256), lut_gemv.lut_gemv_func(get_format("bcq3-g128"), 1024, 256, 1)
    candidates = {}
    for name, f, corner in (("gemv", func, {"lanes": 256, "warps": 4, "cols": 2}),
                            ("lut", lut, {"t_h": 256, "cols": 1, "threads": 256})):
        space = gpu_tune.GpuKnobSpace.of(f, SM80)
        for tag, decisions in (("analytic", space.analytic), ("corner", corner)):
            candidates[f"{name}_{tag}"] = space.schedule(f, decisions).mod["main"]
    check_ptxas(candidates, "sm_80")


def test_rotation_exceeds_twice_l2():
    assert gpu_tune.rotation_copies(22 << 20, 50 << 20) * (22 << 20) > 2 * (50 << 20)
    assert gpu_tune.rotation_copies(1 << 30, 50 << 20) == 2


def test_runner_without_a_device_times_nothing_and_says_so():
    from qtvm.cuda import device_arch, load_cuda_runtime

    load_cuda_runtime()
    if device_arch() is not None:
        pytest.skip("this machine has a CUDA device")
    from tvm.s_tir import meta_schedule as ms

    results = [f.result() for f in gpu_tune.ColdL2Runner().run([ms.runner.RunnerInput("/none", "cuda", [])])]
    assert results[0].run_secs is None and "no CUDA device is present" in results[0].error_msg
    from qtvm.errors import QtvmError

    with pytest.raises(QtvmError, match="needs a CUDA device"):
        gpu_tune.tune_gpu_kernel(gemv(), SM80, 4, "/tmp/unused")


def test_space_generator_builds():
    gen = gpu_tune.space_generator(gpu_tune.GpuKnobSpace.of(gemv(), SM80))
    assert isinstance(gen, tvm.s_tir.meta_schedule.space_generator.ScheduleFn)
