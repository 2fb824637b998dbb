"""CUDA unpack TensorIntrins: one packed run of a column -> fp16 values, in a few
instructions per pair of weights (the fp16 paths; the exact fp32 kernels never use them).

``qtvm_unpack_{kind}_f16x{values}_cuda``: one run of one column of a column-blocked array
(``W[1, words, 1]`` int32, local) -> ``O[1, values]`` fp16 (local). desc: the plain decode,
``unpack_value``, the TIR the fp16 kernels compute; impl: a device function
(``helper_source``) called through TVM's ``cuda.func_call``:
  u4    1 word -> 8 values:  per half2, lop3 ((w >> 4i) & 0x000f000f) | 0x64006400 gives
        the halves 1024 + v_i and 1024 + v_{i+4}: the 0x6400 magic exponent makes the code
        the mantissa of 1024; one hsub2 of 1024 leaves the code, exactly.
  u2    1 word -> 16 values: the same with masks 0x00030003, 8 lop3.
  u8    1 word -> 4 values:  prmt (``__byte_perm``) puts two bytes under 0x64 exponents.
  e0m4  1 word -> 8 values:  Transformer-Lite's decode, one OR into the exponent of 1.0
        (lop3 (w << 6 >> 4i) & 0x03c003c0 | 0x3c003c00 = 1 + v/16 in both halves): no subtract.
  u3    3 words -> 32 values (QIGen's 3-word run, values 10 and 21 straddle words): each
        code by funnel shifts with constant amounts, pairs ORed under 0x6400 by one lop3.
The bit tricks are checked exhaustively in Python (``emulate``, the same constants the
device code uses) and the device code by ptxas; nothing here runs without a GPU.
"""
from __future__ import annotations

import numpy as np
from tvm.script import tirx as T

from qtvm.intrin.runs import F16_ONE, MAGIC_1024, RUNS, register, run_desc, unpack_value  # noqa: F401 (re-exported)

LOP3_AND_OR = 0xEA  # lop3 truth table of (a & b) | c: (0xF0 & 0xCC) | 0xAA
LOP3_OR_OR = 0xFE   # (a | b) | c


def intrin_name(kind: str) -> str:
    return f"qtvm_unpack_{kind}_f16x{RUNS[kind][1]}_cuda"


def helper_name(kind: str) -> str:
    return f"qtvm_unpack_{kind}_f16x{RUNS[kind][1]}"


# -- device code -----------------------------------------------------------------------------
_PRELUDE = """#include <cuda_fp16.h>
#ifndef QTVM_LOP3
#define QTVM_LOP3(d, a, b, c, lut) asm("lop3.b32 %0, %1, %2, %3, " #lut ";" : "=r"(d) : "r"(a), "r"(b), "r"(c))
#endif
"""


def _pairs_source(kind: str) -> str:
    """Device function: one word -> values, by half2 pairs (lane i and i + values / 2)."""
    _, values, bits = RUNS[kind]
    pairs, mask = values // 2, (1 << bits) - 1
    lines = [f"__forceinline__ __device__ void {helper_name(kind)}(const int* w, half* out) {{",
             "  const uint32_t word = (uint32_t)w[0];",
             "  uint32_t h;"]
    for i in range(pairs):
        if kind == "e0m4":
            shift = 6 - bits * i
            src = f"(word << {shift})" if shift >= 0 else f"(word >> {-shift})"
            lines.append(f"  QTVM_LOP3(h, {src}, 0x{(mask << 6) * 0x10001:08x}u, 0x{F16_ONE * 0x10001:08x}u, "
                         f"0x{LOP3_AND_OR:02x});")
            lines.append("  { half2 v = *reinterpret_cast<half2*>(&h);")
        elif kind == "u8":
            selector = i | 4 << 4 | (i + 2) << 8 | 4 << 12  # bytes: b_i, 0x64, b_(i+2), 0x64
            lines.append(f"  h = __byte_perm(word, 0x{MAGIC_1024 >> 8:02x}{MAGIC_1024 >> 8:02x}"
                         f"{MAGIC_1024 >> 8:02x}{MAGIC_1024 >> 8:02x}u, 0x{selector:04x});")
            lines.append("  { half2 v = __hsub2(*reinterpret_cast<half2*>(&h), __float2half2_rn(1024.f));")
        else:
            lines.append(f"  QTVM_LOP3(h, word >> {bits * i}, 0x{mask * 0x10001:08x}u, "
                         f"0x{MAGIC_1024 * 0x10001:08x}u, 0x{LOP3_AND_OR:02x});")
            lines.append("  { half2 v = __hsub2(*reinterpret_cast<half2*>(&h), __float2half2_rn(1024.f));")
        lines.append(f"    out[{i}] = __low2half(v); out[{i + pairs}] = __high2half(v); }}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _u3_source() -> str:
    """Device function: 3 words (32 values of 3 bits, a 96-bit little-endian field) -> 32 values."""
    lines = [f"__forceinline__ __device__ void {helper_name('u3')}(const int* w, half* out) {{",
             "  const uint32_t w0 = (uint32_t)w[0], w1 = (uint32_t)w[1], w2 = (uint32_t)w[2];",
             "  uint32_t a, b, h;"]

    def code(j: int) -> str:
        off = 3 * j
        word, shift = divmod(off, 32)
        lo, hi = ("w0", "w1", "w2")[word], ("w0", "w1", "w2", "w2")[word + 1]
        if shift <= 29:
            return f"(({lo} >> {shift}) & 7u)"
        return f"(__funnelshift_r({lo}, {hi}, {shift}) & 7u)"

    for i in range(16):
        lines.append(f"  a = {code(i)}; b = {code(i + 16)} << 16;")
        lines.append(f"  QTVM_LOP3(h, a, b, 0x{MAGIC_1024 * 0x10001:08x}u, 0x{LOP3_OR_OR:02x});")
        lines.append("  { half2 v = __hsub2(*reinterpret_cast<half2*>(&h), __float2half2_rn(1024.f));")
        lines.append(f"    out[{i}] = __low2half(v); out[{i + 16}] = __high2half(v); }}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def helper_source(kind: str) -> str:
    return _PRELUDE + (_u3_source() if kind == "u3" else _pairs_source(kind))


# -- the same tricks in numpy (to check the constants bit-exactly without a GPU) ---------------
def lop3(a, b, c, lut: int):
    a, b, c = (np.asarray(v, np.uint32) for v in (a, b, c))
    out = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
    for bit in range(8):  # truth table index = (a << 2 | b << 1 | c) over 0xF0, 0xCC, 0xAA
        if lut >> bit & 1:
            sa, sb, sc = (a if bit & 4 else ~a), (b if bit & 2 else ~b), (c if bit & 1 else ~c)
            out |= sa & sb & sc
    return out


def byte_perm(x, y, selector: int):
    x, y = np.asarray(x, np.uint32), np.asarray(y, np.uint32)
    pool = [(x >> 8 * i) & 0xFF for i in range(4)] + [(y >> 8 * i) & 0xFF for i in range(4)]
    return sum(pool[(selector >> 4 * i) & 7] << np.uint32(8 * i) for i in range(4)).astype(np.uint32)


def _halves(h) -> tuple[np.ndarray, np.ndarray]:
    h = np.asarray(h, np.uint32)
    return (h & 0xFFFF).astype(np.uint16).view(np.float16), (h >> 16).astype(np.uint16).view(np.float16)


def emulate(kind: str, words: np.ndarray) -> np.ndarray:
    """What the device function computes, for an array of runs [..., words] -> [..., values]."""
    nwords, values, bits = RUNS[kind]
    words = np.asarray(words).view(np.uint32)
    out = np.zeros(words.shape[:-1] + (values,), np.float16)
    mask = (1 << bits) - 1
    if kind == "u3":
        field = [words[..., 0], words[..., 1], words[..., 2]]
        full = field[0].astype(np.uint64) | field[1].astype(np.uint64) << 32
        for i in range(16):
            codes = []
            for j in (i, i + 16):
                off = 3 * j
                value = (full >> np.uint64(off)) if off < 64 else (field[2].astype(np.uint64) >> np.uint64(off - 64))
                if 61 < off < 64:  # straddles into w2
                    value = value | (field[2].astype(np.uint64) << np.uint64(64 - off))
                codes.append((value & np.uint64(7)).astype(np.uint32))
            h = lop3(codes[0], codes[1] << np.uint32(16), MAGIC_1024 * 0x10001, LOP3_OR_OR)
            lo, hi = _halves(h)
            out[..., i], out[..., i + 16] = lo - np.float16(1024), hi - np.float16(1024)
        return out
    word = words[..., 0]
    for i in range(values // 2):
        if kind == "e0m4":
            shift = 6 - bits * i
            src = word << np.uint32(shift) if shift >= 0 else word >> np.uint32(-shift)
            lo, hi = _halves(lop3(src, (mask << 6) * 0x10001, F16_ONE * 0x10001, LOP3_AND_OR))
            out[..., i], out[..., i + values // 2] = lo, hi
        elif kind == "u8":
            lo, hi = _halves(byte_perm(word, 0x64646464, i | 4 << 4 | (i + 2) << 8 | 4 << 12))
            out[..., i], out[..., i + 2] = lo - np.float16(1024), hi - np.float16(1024)
        else:
            lo, hi = _halves(lop3(word >> np.uint32(bits * i), mask * 0x10001, MAGIC_1024 * 0x10001, LOP3_AND_OR))
            out[..., i], out[..., i + values // 2] = lo - np.float16(1024), hi - np.float16(1024)
    return out


# -- TensorIntrins -------------------------------------------------------------------------------
def _make(kind: str):
    from tvm.backend.cuda.op import cuda_func_call

    words, values, _ = RUNS[kind]
    source = helper_source(kind)

    desc = run_desc(kind)

    @T.prim_func(s_tir=True)
    def impl(w: T.handle, o: T.handle) -> None:
        W = T.match_buffer(w, (1, words, 1), "int32", offset_factor=1, scope="local")
        O = T.match_buffer(o, (1, values), "float16", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(W[0, 0:words, 0])
            T.writes(O[0, 0:values])
            T.evaluate(cuda_func_call(helper_name(kind), W.access_ptr("r"), O.access_ptr("w"), source_code=source))

    return desc, impl


register(intrin_name, _make, RUNS)
