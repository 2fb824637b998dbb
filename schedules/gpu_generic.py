"""GPU schedules for everything around the packed kernels (norms, RoPE, softmax,
attention matmuls, SwiGLU, embedding gathers), CUDA and OpenCL targets.

:func:`schedule_generic_ops` runs before ``tvm.compile``:

1. the qtvm kernels are marked opaque (fusion never touches them), then TVM's own GPU
   passes legalize and fuse the rest (library dispatch -- cumsum becomes TVM's GPU scan --,
   LegalizeOps, FuseOps, FuseTIR);
2. the mixed format's CSR outlier functions get their rule (``gpu_sparse``);
3. every other fused PrimFunc is scheduled by TVM's dlight GPU rules (``tvm.s_tir.dlight``:
   Matmul, GEMV, Reduction, GeneralReduction, Fallback; RMSNorm ahead of them), the same
   rules TVM's default CUDA pipeline applies.

Each rule's result was checked differentially on the bundled model: every scheduled
function run on PoCL (``qtvm.testing.opencl``) against the unscheduled function compiled
for the CPU, with the symbolic dims bound to 1, 3, 64 and 67
(``tests/schedules/test_gpu_generic.py``). A rule found wrong goes into ``EXCLUDED`` and
that structure gets a rule of its own here.

The functions come out marked ``tirx.is_scheduled``, so ``tvm.compile``'s own pipeline
(which runs the same legalize/fuse/dlight passes again) leaves them alone.
"""
from __future__ import annotations

import tvm
from tvm import relax, tirx

from qtvm.formats.mixed import SPARSE_ATTR

_OPAQUE = 8  # relax OpPatternKind.kOpaque


#: TVM 0.27 spells the "already scheduled" mark ``tirx.is_scheduled`` (dlight and the GPU
#: pipeline read it); qtvm's kernels also carry the older ``tir.is_scheduled``.
SCHEDULED = "tirx.is_scheduled"


def is_scheduled(func: tirx.PrimFunc) -> bool:
    attrs = func.attrs or {}
    return "qtvm.kernel" in attrs or any(bool(attrs.get(key, False)) for key in (SCHEDULED, "tir.is_scheduled"))


def dlight_rules() -> list:
    from tvm.s_tir import dlight as dl

    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.RMSNorm(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback()]


def legalize_and_fuse(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """TVM's GPU legalization and fusion, with the qtvm kernels opaque; Relax functions
    nothing calls (the artefact's metadata function) are kept."""
    from tvm.relax.backend import gpu_generic

    marked = {gv: f.with_attrs({"op_pattern": _OPAQUE, **({SCHEDULED: True} if is_scheduled(f) else {})})
              for gv, f in mod.functions.items()
              if isinstance(f, tirx.PrimFunc) and (is_scheduled(f) or SPARSE_ATTR in (f.attrs or {}))}
    mod = mod.clone()
    for gv, func in marked.items():
        mod[gv] = func
    relax_funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    passes = gpu_generic.library_dispatch_passes(target) + [
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
        relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with target:
        mod = tvm.transform.Sequential(passes)(mod)
    present = {gv.name_hint for gv in mod.get_global_vars()}
    for name, func in relax_funcs.items():
        if name not in present:
            mod[name] = func
    return mod


def schedule_generic_ops(mod: tvm.IRModule, target: tvm.target.Target, rules: list | None = None) -> tvm.IRModule:
    """Fuse and schedule the non-kernel ops of a Relax module for a GPU target."""
    from tvm.s_tir import dlight as dl

    from schedules.gpu_sparse import schedule_outliers_gpu

    if target.kind.name not in ("cuda", "opencl"):
        return mod
    mod = legalize_and_fuse(mod, target)
    updates = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and SPARSE_ATTR in (func.attrs or {}) and not is_scheduled(func):
            updates[gv] = schedule_outliers_gpu(func, target).mod["main"].with_attr(SCHEDULED, True)
    for gv, func in updates.items():
        mod[gv] = func
    with target:
        mod = dl.ApplyDefaultSchedule(*(rules if rules is not None else dlight_rules()))(mod)
    return mod
