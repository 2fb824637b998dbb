"""What every target's fp16 unpack TensorIntrin computes (``qtvm.intrin.cuda``,
``qtvm.intrin.opencl``), shared with the fp16 compute (``qtvm.ops.qmatmul_f16_func``):
the geometry of each packed run kind, the plain decode of one value, and the intrinsics'
desc (that decode over one run), so the targets differ only in their impl.

The fp16 bit patterns both targets build (pairs of halves in one 32-bit word):
  uniform codes: ``MAGIC_1024 | code`` is the half 1024 + code (exponent 10: the mantissa
  holds an integer exactly), so one subtract of 1024 leaves the code;
  E0M4: ``F16_ONE | code << 6`` is 1 + code / 16, no subtract (Transformer-Lite).
"""
from __future__ import annotations

from tvm.script import tirx as T

#: kind -> (int32 words per run, values per run, code bits)
RUNS = {"u4": (1, 8, 4), "u2": (1, 16, 2), "u8": (1, 4, 8), "e0m4": (1, 8, 4), "u3": (3, 32, 3)}
MAGIC_1024 = 0x6400  # fp16 1024.0: exponent 10, so mantissa bits 0..9 hold an integer exactly
F16_ONE = 0x3C00


def unpack_value(kind: str, word, j):
    """fp16 value ``j`` of a run whose int32 word ``r`` is ``word(r)`` (TIR)."""
    words, values, bits = RUNS[kind]
    if kind == "u3":
        from qtvm.formats.uniform import UniformFormat

        code = UniformFormat(3, None)._te_code(word, j)
        return code.astype("float16")
    per_word = values // words
    code = (word(j // per_word) >> ((j % per_word) * bits).astype("int32")) & ((1 << bits) - 1)
    if kind == "e0m4":  # 1 + code / 16, exact in fp16
        return (code.astype("float32") * 0.0625 + 1.0).astype("float16")
    return code.astype("float16")


def run_desc(kind: str):
    """The TensorIntrin desc: one run of one column of a column-blocked array
    (``W[1, words, 1]`` int32, local) -> ``O[1, values]`` fp16 (local), by the plain decode."""
    words, values, _ = RUNS[kind]

    @T.prim_func(s_tir=True)
    def desc(w: T.handle, o: T.handle) -> None:
        W = T.match_buffer(w, (1, words, 1), "int32", offset_factor=1, scope="local")
        O = T.match_buffer(o, (1, values), "float16", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(W[0, 0:words, 0])
            T.writes(O[0, 0:values])
            for j in range(values):
                with T.sblock("unpack"):
                    vj = T.axis.spatial(values, j)
                    O[0, vj] = unpack_value(kind, lambda r: W[0, r, 0], vj)

    return desc


def register(name, make, kinds) -> None:
    """Register ``name(kind)`` -> ``make(kind)`` (desc, impl) for each kind, once per process."""
    from tvm import s_tir

    for kind in kinds:
        try:
            s_tir.TensorIntrin.get(name(kind))
        except Exception:  # not registered yet
            s_tir.TensorIntrin.register(name(kind), *make(kind))
