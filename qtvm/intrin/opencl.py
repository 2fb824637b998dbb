"""OpenCL unpack TensorIntrins: one packed run of a column -> fp16 values by the exponent
tricks, written with OpenCL's own ``as_half2`` (32 bits read as two halves), which TVM's
OpenCL code generator prints as is through ``call_pure_extern``.

``qtvm_unpack_{kind}_f16x{values}_opencl``: ``W[1, words, 1]`` int32 -> ``O[1, values]`` fp16,
both local (the desc is ``qtvm.intrin.runs.run_desc``: the plain decode). Per pair of values
(i, i + values / 2), one 32-bit word ``q`` holds both codes, one in each half:
  u4, u2, u8   q = (w >> bits * i) & mask-per-half;  as_half2(0x64006400 | q) - 1024
               (the magic exponent: 1024 + code exactly, one subtract leaves the code)
  e0m4         q = (w >> 4i) & 0x000F000F;  as_half2(0x3C003C00 | q << 6) = 1 + code / 16
               (Transformer-Lite's ``as_half(EXP | (q << SHIFT))``: no subtract at all)
  u3           QIGen's 3-word run (values 10 and 21 straddle words): q = code(i) | code(i + 16) << 16
               by shifts, then the magic exponent as for u4
so a pair of weights costs a shift, an and, an or and one half2 subtract (none for E0M4),
against two integer-to-float conversions. The constants are those of ``qtvm.intrin.cuda``
(whose ``emulate`` checks them bit-exactly); here the kernels themselves run on PoCL, whose
``as_half2`` the harness emulates with ``vload_half2`` (PoCL has no cl_khr_fp16).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from qtvm.intrin.runs import F16_ONE, MAGIC_1024, RUNS, register, run_desc

#: Run kinds with an OpenCL intrinsic (all of them).
KINDS = tuple(RUNS)


def intrin_name(kind: str) -> str:
    return f"qtvm_unpack_{kind}_f16x{RUNS[kind][1]}_opencl"


def _u32(value: int):
    return tirx.const(value, "uint32")


def pair_bits(kind: str, word, i):
    """The uint32 holding values i and i + values / 2 of a run as two fp16 bit patterns
    (``word(r)``: the run's int32 word r; ``i``: a TIR index)."""
    words, values, bits = RUNS[kind]
    if kind == "u3":
        from qtvm.formats.uniform import UniformFormat

        code = lambda j: UniformFormat(3, None)._te_code(word, j).astype("uint32")  # noqa: E731
        return code(i) | (code(i + values // 2) << _u32(16)) | _u32(MAGIC_1024 * 0x10001)
    mask = ((1 << bits) - 1) * 0x10001
    q = (word(0).astype("uint32") >> (i * bits).astype("uint32")) & _u32(mask)
    if kind == "e0m4":
        return (q << _u32(6)) | _u32(F16_ONE * 0x10001)
    return q | _u32(MAGIC_1024 * 0x10001)


def pair_value(kind: str, word, i):
    """Values i and i + values / 2 of a run as a half2 (TIR)."""
    halves = tirx.call_pure_extern("float16x2", "as_half2", pair_bits(kind, word, i))
    if kind == "e0m4":
        return halves
    return halves - tirx.Broadcast(tirx.const(1024.0, "float16"), 2)


def _make(kind: str):
    words, values, _ = RUNS[kind]
    pairs = values // 2

    @T.prim_func(s_tir=True)
    def impl(w: T.handle, o: T.handle) -> None:
        W = T.match_buffer(w, (1, words, 1), "int32", offset_factor=1, scope="local")
        O = T.match_buffer(o, (1, values), "float16", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(W[0, 0:words, 0])
            T.writes(O[0, 0:values])
            for i in T.unroll(pairs):
                O[0, T.Ramp(i, pairs, 2)] = pair_value(kind, lambda r: W[0, r, 0], i)

    return run_desc(kind), impl


register(intrin_name, _make, KINDS)
