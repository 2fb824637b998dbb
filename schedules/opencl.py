"""The OpenCL family: phone GPUs (Arm Mali, Qualcomm Adreno) and any other OpenCL device.

The device comes from the target -- ``opencl -device=mali`` (Valhall), ``-device=mali
-model=bifrost``, ``-device=adreno`` -- and picks a row of :data:`DEVICES`, the facts the
rules read (as ``target_facts.py`` is for x86). The kernels keep the GPU family's
structure (``schedules/gpu*.py``); what is OpenCL's own:

  opencl_gemv.py  decode GEMV: the split-K GEMV of ``gpu_gemv`` with the device's subgroup as
                  the lanes splitting K, 128-bit loads of weights and activations, and the fp16
                  path's packed runs decoded by ``qtvm.intrin.opencl`` (``as_half2`` magic
                  exponents; E0M4 as Transformer-Lite's ``as_half(EXP | q << SHIFT)``);
                  ``--act fp16`` sums in fp32, ``--act fp16-acc16`` each lane's chunk in fp16
  prefill GEMM, LUT-GEMM (BCQ), CSR outliers: ``gpu_gemm``, ``gpu_lut``, ``gpu_sparse`` with
                  the device's local memory and work-group size (``gpu.params`` reads the row)
  ops around the kernels: ``gpu_generic`` (TVM's dlight GPU rules; the target carries the
                  device's limits, filled in by ``qtvm.target``)

Cross-thread sums go through local memory on every OpenCL device (``thread_warp_size`` 1):
TVM lowers OpenCL warp shuffles to Intel's ``intel_sub_group_shuffle``, which neither Mali
nor Adreno has. None of this ran on a Mali or Adreno GPU here; PoCL (x86) ran every kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm

from schedules import gpu


@dataclass(frozen=True)
class OpenCLDevice:
    """Facts of one OpenCL GPU family, as its vendor documents them (a device's own clinfo
    wins; none was available here).

    subgroup: threads that run in lockstep (Mali warp, Adreno wave); the GEMV's lanes.
    local_mem_bytes: local memory per work-group.  max_work_group: work-items per group.
    images: whether image (texture) reads are the vendor's recommended path for weights.
    vector_bytes: preferred load width per work-item (16: int4, float4, half8).
    gemv_subgroups, gemv_cols: subgroups per GEMV work-group, columns per subgroup.
    """

    name: str
    subgroup: int
    local_mem_bytes: int
    max_work_group: int
    images: bool
    vector_bytes: int = 16
    gemv_subgroups: int = 4
    gemv_cols: int = 4
    about: str = ""

    def gpu_params(self) -> gpu.GpuParams:
        return gpu.GpuParams(kind="opencl", warp=1, max_threads=self.max_work_group, shared_bytes=self.local_mem_bytes,
                             lanes=self.subgroup, warps=self.gemv_subgroups, cols=self.gemv_cols)

    def target_attrs(self) -> dict:
        """The limits TVM's own GPU rules (dlight) read from the target."""
        return {"max_num_threads": self.max_work_group, "max_threads_per_block": self.max_work_group,
                "max_shared_memory_per_block": self.local_mem_bytes, "thread_warp_size": 1}


DEVICES = {
    "mali": OpenCLDevice(
        "mali", subgroup=16, local_mem_bytes=32 << 10, max_work_group=512, images=False,
        about="Arm Mali Valhall (G57, G77, G78, G710, G715, G720): 16-wide warps, 32 KiB local memory "
              "carved from the same caches as global memory; Arm's guide: 128-bit vector loads, buffers "
              "rather than images for compute data"),
    "mali-bifrost": OpenCLDevice(
        "mali-bifrost", subgroup=8, local_mem_bytes=32 << 10, max_work_group=384, images=False,
        gemv_subgroups=8, about="Arm Mali Bifrost (G71/G72: 4-wide warps, G52/G76: 8-wide), 32 KiB local memory"),
    "adreno": OpenCLDevice(
        "adreno", subgroup=64, local_mem_bytes=32 << 10, max_work_group=1024, images=True, gemv_subgroups=2,
        about="Qualcomm Adreno 6xx/7xx: waves of 64 (128 in the half-register mode), 32 KiB local memory, "
              "weights read through the texture cache (image objects) in Qualcomm's own LLM kernels"),
}


def device(target: tvm.target.Target) -> OpenCLDevice | None:
    """The row for an OpenCL target's ``-device`` (and ``-model=bifrost``), None for others."""
    if target.kind.name != "opencl":
        return None
    name = str(target.attrs.get("device", "") or "")
    model = str(target.attrs.get("model", "") or "").lower()
    if name == "mali" and model == "bifrost":
        name = "mali-bifrost"
    return DEVICES.get(name)


#: ``--act`` fp16 modes on OpenCL -> the dtype each lane's chunk is summed in.
F16_ACCUMULATE = {"fp16": "float32", "fp16-acc16": "float16"}


def f16_activations(fmt, k: int) -> bool:
    """The fp16 GEMV serves a format whose decode has an OpenCL unpack intrinsic (every
    uniform width and E0M4), with lane chunks of whole packed runs."""
    from qtvm.intrin.opencl import KINDS
    from qtvm.intrin.runs import RUNS
    from qtvm.ops import f16_unpack_kind

    kind = f16_unpack_kind(fmt)
    return kind in KINDS and gpu.lane_chunk(fmt, k) % RUNS[kind][1] == 0


def facts(target: tvm.target.Target):
    from dataclasses import replace

    return replace(gpu.facts(target), family="opencl", activations=("fp32", *F16_ACCUMULATE),
                   f16_activations=f16_activations, f16_accumulate=dict(F16_ACCUMULATE))


def rules() -> list:
    from schedules import gpu_gemm, gpu_lut, gpu_sparse, opencl_gemv

    return [opencl_gemv.schedule_qmatmul_opencl, gpu_gemm.schedule_qmatmul_gemm_gpu, gpu_lut.schedule_lut_gemv_gpu,
            gpu_sparse.schedule_outliers_gpu]


def dlight_rules() -> list:
    """TVM's dlight GPU rules as ``gpu_generic`` runs them, but dlight's Matmul with its
    generic config on OpenCL: its Adreno config (also taken for any OpenCL target with an
    Android host) stores 8-vectors whose addresses hold symbolic floor divisions, and TVM
    0.27's OpenCL code generator then prints the division's helper variables inside the
    ``vstore8`` call: the source does not compile (the bundled model's attention matmul)."""
    from tvm.s_tir import dlight as dl

    from schedules.gpu_generic import dlight_rules as gpu_rules

    class Matmul(dl.gpu.Matmul):
        def get_configs(self, target):
            return dl.gpu.Matmul.Config() if target.kind.name == "opencl" else super().get_configs(target)

    return [Matmul() if isinstance(rule, dl.gpu.Matmul) else rule for rule in gpu_rules()]


def schedule_generic_ops(mod, target: tvm.target.Target):
    from schedules.gpu_generic import schedule_generic_ops as generic

    return generic(mod, target, rules=dlight_rules())


def relax_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    return gpu.relax_pipeline(target)
