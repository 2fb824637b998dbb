"""MetaSchedule for the GPU decode kernels, seeded by the analytic schedule, timed with the
weights cold in L2.

Design space: the GPU rules themselves with their knobs sampled (``sample_categorical``,
the analytic value carrying half the probability), as the x86 tuner does
(``schedules/tune.py``, whose knob mutator this reuses):

  qmatmul (``gpu_gemv``)   lanes (threads splitting K), warps (per block), cols (per warp)
  lut_gemv (``gpu_lut``)   t_h (rows of K per table slice), cols (per thread), threads

Runner: ``ColdL2Runner`` times a candidate on the CUDA device with its weight arguments
rotated over enough copies that they total more than twice the GPU's L2 (the target's
``l2_cache_size_bytes``), so each call streams its weights from HBM as in a model, where
other layers' weights evict them; MetaSchedule's own runner reuses one set of arguments,
which keeps a decode kernel's weights in L2 (50 MB on an H100 holds a 4096 x 11008 int4
matrix) and ranks schedules by cache-hot speed.

Where this was run: only the candidate generation and builds (CUDA source through nvcc,
ptxas) -- no GPU was available, so ``ColdL2Runner`` and ``tune_gpu_kernel`` never timed
anything; without a device the runner reports every candidate as failed, saying why.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm
from tvm import s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from qtvm import lut_gemv, ops
from schedules import gpu, gpu_gemv, gpu_lut

KNOB_PREFIX = "qtvm.knob."
ANALYTIC_SHARE = 0.5


@dataclass(frozen=True)
class GpuKnobSpace:
    kernel: str
    desc: dict
    knobs: dict      # name -> candidate values (analytic value first)
    analytic: dict
    gemv_extras: dict = field(default_factory=dict)  # the target's fp16 unpack intrinsics, activation loads

    @staticmethod
    def of(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> "GpuKnobSpace":
        kernel, desc = str(func.attrs[ops.KERNEL_ATTR]), dict(func.attrs[ops.FORMAT_ATTR])
        p = gpu.params(target)
        if kernel in ("qmatmul", "qmatmul_f16"):
            analytic = gpu_gemv.launch(desc, p)
            cands = ({"lanes": (32, 64, 128, 256), "warps": (1, 2, 4), "cols": (2, 4)} if p.kind == "cuda"
                     else {"lanes": (8, 16, 32), "warps": (2, 4, 8), "cols": (2, 4)})
        elif kernel == lut_gemv.KERNEL:
            group, kp = int(desc["group"]), int(desc["padded_k"])
            analytic = {"t_h": group, "cols": gpu_lut.COLS, "threads": gpu_lut.THREADS}
            slices = [t for t in (group, 2 * group, 4 * group)
                      if kp % t == 0 and t // lut_gemv.MU * lut_gemv.TABLE * 4 <= p.shared_bytes]
            # 4 columns a thread made ptxas (13.0, TVM's --register-usage-level=10) abort
            cands = {"t_h": tuple(slices), "cols": (1, 2), "threads": (64, 128, 256)}
        else:
            raise ValueError(f"no GPU design space for '{kernel}' kernels")
        knobs = {name: (analytic[name], *[v for v in values if v != analytic[name]])
                 for name, values in cands.items()}
        return GpuKnobSpace(kernel, desc, knobs, analytic, gemv_extras=_gemv_extras(desc, target))

    def apply(self, sch: s_tir.Schedule, decisions: dict | None = None) -> dict:
        """Schedule ``sch`` with sampled knobs (or the given values); returns the values."""
        decisions = decisions or {}
        chosen = {}
        out = sch.get_sblock(ops.BLOCK_OUT)
        for name, values in self.knobs.items():
            probs = [ANALYTIC_SHARE] + [(1 - ANALYTIC_SHARE) / (len(values) - 1)] * (len(values) - 1) \
                if len(values) > 1 else [1.0]
            fixed = decisions.get(name)
            rv = sch.sample_categorical(list(values), probs,
                                        decision=None if fixed is None else list(values).index(fixed))
            chosen[name] = int(sch.get(rv))
            sch.annotate(out, KNOB_PREFIX + name, rv)
        if self.kernel == lut_gemv.KERNEL:
            gpu_lut.apply_lut_gemv_gpu(sch, self.desc, **chosen)
        else:
            gpu_gemv.apply_qmatmul_gpu(sch, self.desc, **self.gemv_extras, **chosen)
        return chosen

    def design_spaces(self, sch: s_tir.Schedule) -> list[s_tir.Schedule]:
        self.apply(sch)
        return [sch]

    def schedule(self, func: tvm.tirx.PrimFunc, decisions: dict | None = None) -> s_tir.Schedule:
        sch = s_tir.Schedule(func)
        self.apply(sch, decisions)
        return sch


def _gemv_extras(desc, target: tvm.target.Target) -> dict:
    """The analytic GEMV rule's own additions for the target (CUDA's or OpenCL's intrinsics,
    the width of the activation loads)."""
    if target.kind.name == "opencl":
        from schedules.opencl_gemv import gemv_extras

        return gemv_extras(desc, target)
    from qtvm.intrin import cuda

    if target.kind.name != "cuda":
        return {}
    return {"intrinsics": cuda, "x_vector": gpu_gemv.x_vector(desc, gpu.params(target).x_bytes)}


def space_generator(space: GpuKnobSpace) -> ms.space_generator.ScheduleFn:
    from schedules.tune import MutateKnob

    return ms.space_generator.ScheduleFn(space.design_spaces, sch_rules=[], postprocs=[],
                                         mutator_probs={MutateKnob(): 1.0})


def trace_knobs(trace) -> dict:
    """The knob values a trace of this design space chose (its knob annotations)."""
    sampled, knobs = {}, {}
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical" and inst in trace.decisions:
            sampled[inst.outputs[0]] = int(inst.attrs[0][int(trace.decisions[inst])])
        elif inst.kind.name == "Annotate" and str(inst.attrs[0]).startswith(KNOB_PREFIX):
            value = inst.inputs[1]
            knobs[str(inst.attrs[0])[len(KNOB_PREFIX):]] = sampled.get(value) if isinstance(value, tvm.tirx.Var) \
                else int(value)
    return knobs


def rotation_copies(weight_bytes: int, l2_bytes: int) -> int:
    """Weight copies whose total exceeds twice the L2: every call finds its weights evicted."""
    return max(2, -(-2 * l2_bytes // max(1, weight_bytes)) + 1)


@derived_object
class CudaBuilder(ms.builder.PyBuilder):
    """Builds candidates in this process with qtvm's CUDA settings (``qtvm.cuda``: nvcc,
    no fast math, the driver or its stub)."""

    def build(self, build_inputs):
        from tvm.support.tar import tar

        from qtvm.cuda import compile_settings

        results = []
        for item in build_inputs:
            try:
                with compile_settings(item.target):
                    rt_mod = tvm.tirx.build(item.mod, target=item.target)
                path = Path(tempfile.mkdtemp(prefix="qtvm-gpu-tune-")) / f"kernel.{tar.output_format}"
                rt_mod.export_library(str(path), fcompile=tar)
                results.append(ms.builder.BuilderResult(str(path), None))
            except Exception as e:  # noqa: BLE001 -- a failed candidate is a result
                results.append(ms.builder.BuilderResult(None, f"{type(e).__name__}: {e}"[:2000]))
        return results


@derived_object
class ColdL2Runner(ms.runner.PyRunner):
    """Times candidates on CUDA device 0 with the weights rotated through > 2x L2."""

    def __init__(self, l2_bytes: int = 50 << 20, repeat: int = 20) -> None:
        self.l2_bytes, self.repeat = l2_bytes, repeat

    def run(self, runner_inputs):
        from qtvm.cuda import device_arch, load_cuda_runtime

        load_cuda_runtime()
        if device_arch() is None:
            return [_Done(None, "no CUDA device is present: nothing timed") for _ in runner_inputs]
        return [_Done(*self._time(item)) for item in runner_inputs]

    def _time(self, item):
        try:
            dev = tvm.cuda(0)
            func = tvm.runtime.load_module(item.artifact_path)["main"]
            infos = list(item.args_info)
            rng = np.random.default_rng(0)

            def tensor(info):
                shape, dtype = [int(d) for d in info.shape], str(info.dtype)
                data = rng.standard_normal(shape).astype(dtype) if dtype.startswith("float") else \
                    rng.integers(0, 1 << 16, shape).astype(dtype)
                return tvm.runtime.tensor(data, device=dev)

            x, y = tensor(infos[0]), tensor(infos[-1])
            weights = [tensor(i) for i in infos[1:-1]]
            wbytes = sum(int(np.prod([int(d) for d in i.shape])) * np.dtype(str(i.dtype)).itemsize for i in infos[1:-1])
            sets = [weights] + [[tvm.runtime.tensor(w.numpy(), device=dev) for w in weights]
                                for _ in range(rotation_copies(wbytes, self.l2_bytes) - 1)]
            func(x, *sets[0], y)  # load the module onto the device
            dev.sync()
            secs = []
            for _ in range(self.repeat):
                start = time.perf_counter()
                for ws in sets:
                    func(x, *ws, y)
                dev.sync()
                secs.append((time.perf_counter() - start) / len(sets))
            return secs, None
        except Exception as e:  # noqa: BLE001
            return None, f"{type(e).__name__}: {e}"[:2000]


def _Done(run_secs, error) -> ms.runner.RunnerFuture:
    """A finished measurement (the runner times synchronously)."""
    result = ms.runner.RunnerResult(run_secs, error)
    return ms.runner.RunnerFuture(lambda: True, lambda: result)


def tune_gpu_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target, trials: int, work_dir) -> dict:
    """MetaSchedule over the kernel's knobs on this machine's GPU; the best knob values
    (the analytic ones when nothing beat them). Needs a CUDA device."""
    from qtvm.cuda import device_arch, load_cuda_runtime
    from qtvm.errors import QtvmError
    from schedules.tune import specialize_rows

    load_cuda_runtime()
    if device_arch() is None:
        raise QtvmError("tuning CUDA kernels needs a CUDA device; none is present", "run it on a machine with a GPU")
    space = GpuKnobSpace.of(func, target)
    static = specialize_rows(func, 1)
    runner = ColdL2Runner(int(target.attrs.get("l2_cache_size_bytes", 50 << 20)))
    db = ms.tune_tir(tvm.IRModule({"main": static}), target, str(work_dir), max_trials_global=trials,
                     space=space_generator(space), builder=CudaBuilder(), runner=runner)
    records = db.get_top_k(db.commit_workload(tvm.IRModule({"main": static})), 1)
    if not records:
        return dict(space.analytic)
    knobs = {k: v for k, v in trace_knobs(records[0].trace).items() if v is not None}
    return {**space.analytic, **knobs}
