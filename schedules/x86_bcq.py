"""Schedule rule for the int8 nibble-table BCQ GEMV (``qtvm.bcq_a8_gemv``) on AVX-512 VBMI + VNNI.

x's per-group int8 rounding and the int8 tables at the root (as the int16-table kernel's
rounding and tables), then the int16-table kernel's loop nest (``schedules.x86_lut._lookups``):
parallel over column blocks, per group, block and plane one TensorIntrin per 16 columns
(``qtvm.intrin.x86_bcq``: 4 ``vpermb`` lookups, 2 byte adds and 2 ``vpdpbusd``) adds into the plane's
int32 partials, kept in registers; the group's alphas, bias and x scale fold them into the
output accumulator.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from qtvm import bcq_a8_gemv, ops
from schedules.x86_lut import _lookups, _tables_at_root, lut_prefetch_bytes, round_x_at_root


def bcq_a8_isa(target: tvm.target.Target) -> bool:
    """Whether ``target`` has ``vpermb`` (AVX-512 VBMI) and ``vpdpbusd`` (AVX-512 VNNI) on zmm
    (both imply AVX-512BW): Ice Lake and later Intel, Zen 4/5. Cascade Lake has VNNI without
    VBMI, so it keeps the int16 tables."""
    from tvm.target import codegen

    if target.kind.name != "llvm":
        return False
    with target:
        return all(bool(codegen.llvm_cpu_has_features(f, target)) for f in ("avx512bw", "avx512vbmi", "avx512vnni"))


def schedule_bcq_a8_gemv_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target, **knobs
                             ) -> s_tir.Schedule | None:
    """The rule (``knobs``: see ``apply_bcq_a8_x86``; none: the target's facts)."""
    if (target.kind.name != "llvm" or func.attrs is None
            or str(func.attrs.get(ops.KERNEL_ATTR, "")) != bcq_a8_gemv.KERNEL or not bcq_a8_isa(target)):
        return None
    sch = s_tir.Schedule(func)
    apply_bcq_a8_x86(sch, target, **knobs)
    return sch


def apply_bcq_a8_x86(sch: s_tir.Schedule, target: tvm.target.Target, *, prefetch_bytes: int | None = None,
                     unroll=0) -> None:
    """``prefetch_bytes``: how far ahead each step prefetches the bit stream (None: the
    target's facts for this kernel; 0: none). ``unroll``: as ``apply_lut16_x86``'s."""
    from qtvm.intrin import x86_bcq

    if prefetch_bytes is None:
        prefetch_bytes = lut_prefetch_bytes(target, a8=True, nibble=True)
    round_x_at_root(sch)
    _tables_at_root(sch, bcq_a8_gemv.BLOCK_LUT)
    name = x86_bcq.intrin_name(int(prefetch_bytes) // 4)
    _lookups(sch, sch.mod["main"].attrs[ops.FORMAT_ATTR], name, halves=False, unroll=unroll,
             partial=bcq_a8_gemv.BLOCK_PARTIAL, inner=4)


def prefer_bcq_a8(fmt, k: int, target: tvm.target.Target) -> bool:
    """Whether a decode-sized BCQ matmul with ``--act int8`` runs this kernel rather than the
    int16-table one: on AVX-512 VBMI + VNNI targets, for the shapes the int16 tables serve (the
    same x rounding). Measured faster on every BCQ preset tried (bcq2/3/4, groups 32/64/128;
    cache-hot 1.2-4x on Emerald Rapids, docs/bench_gemv_emr.md); cold it reads the core's
    stream as the int16 kernel does (1.02-1.11x)."""
    return bcq_a8_gemv.supports(fmt, k) and bcq_a8_isa(target)
