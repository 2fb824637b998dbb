"""x86 TensorIntrin of the nibble-table int8 BCQ GEMV (``qtvm.bcq_a8_gemv``).

``qtvm_bcq_nib8_i32x16_avx512vnni``: for one 32-row block of one binary plane and 16 columns
(their 16 int32 words) and the block's 4 int8 tables of 64 bytes (nibble half h x part
(xl, xh) x 4 quads x 16 entries), add to each column's int32 its signed sum sum_k xq_k s_k
over the block. Indices: the low nibbles of the words' bytes with the byte position in bits
4-5 (``(w & 0x0F0F0F0F) | 0x30201000``, LLVM's ``vpternlogd``), and the same of ``w >> 4``
for the high nibbles; ``vpermb`` reads only bits 0-5 of an index. The two halves' looked-up
bytes are added first (``vpaddb``: xl entries in [-60, 60] sum to [-120, 120], xh entries in
[-32, 32] to [-64, 64], both exact in int8), then dotted into the columns' int32s, the xl sum
with u8 ones and the xh sum with u8 sixteens (``vpdpbusd``): 2 dots per step instead of 4 dots,
a zeroed second chain and its add (on Zen 4, 39 -> 42 GB/s cache-hot at 4096 x 4096 bcq3, the
same from DRAM). Each call prefetches the bit stream a distance ahead (one 64-byte line per
call), as the int16-table lookup does.
"""
from __future__ import annotations

import re

from tvm import tirx
from tvm.script import tirx as T

from qtvm.intrin.x86 import _register, _vpdpbusd, _with_block_body
from qtvm.intrin.x86_lut import _prefetch_line

COLS, HALVES, PARTS, QUADS, ENTRIES = 16, 2, 2, 4, 16

# Default prefetch distance in words: 4 KiB, the int16-table kernel's default (the same
# bit stream); a knob (``intrin_name(prefetch)``), measured in docs/bench_gemv_emr.md.
PREFETCH_WORDS = 1024


def intrin_name(prefetch: int | None = None) -> str:
    """The step's name, registered on first use; ``prefetch``: words ahead (None: default, 0: none)."""
    words = PREFETCH_WORDS if prefetch is None else int(prefetch)
    name = f"qtvm_bcq_nib8_i32x{COLS}_avx512vnni" + ("" if words == PREFETCH_WORDS else f"_pf{words}")
    _register(name, lambda: _make(words))
    return name


def _const(v: int):
    return T.broadcast(T.int32(v), COLS)


def _make(prefetch: int):
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, w: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (HALVES, PARTS, QUADS, ENTRIES), "int8", offset_factor=1)
        W = T.match_buffer(w, (COLS,), "int32", offset_factor=1)
        C = T.match_buffer(c, (COLS,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:COLS], W[0:COLS], A[0:HALVES, 0:PARTS, 0:QUADS, 0:ENTRIES])
            T.writes(C[0:COLS])
            for j, h, part, pos, p in T.grid(COLS, HALVES, PARTS, QUADS, ENTRIES):
                with T.sblock("update"):
                    vj, vh, vpart, vpos, vp = T.axis.remap("SRRRR", [j, h, part, pos, p])
                    C[vj] = C[vj] + T.Select(
                        T.bitwise_and(T.shift_right(W[vj], vpos * 8 + vh * 4), 15) == vp,
                        T.Cast("int32", A[vh, vpart, vpos, vp]) * (vpart * 15 + 1), 0)

    @T.prim_func(s_tir=True)
    def skeleton(a: T.handle, w: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (HALVES, PARTS, QUADS, ENTRIES), "int8", offset_factor=1)
        W = T.match_buffer(w, (COLS,), "int32", offset_factor=1)
        C = T.match_buffer(c, (COLS,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:COLS], W[0:COLS], A[0:HALVES, 0:PARTS, 0:QUADS, 0:ENTRIES])
            T.writes(C[0:COLS])
            T.evaluate(0)  # replaced below

    A, W, C = skeleton.params
    words = W.vload([0], f"int32x{COLS}")
    scale = {0: T.broadcast(T.int8(1), 64), 1: T.broadcast(T.int8(16), 64)}  # u8 ones / sixteens
    looked_up = {0: [], 1: []}  # part -> the two halves' entries
    for h in range(HALVES):
        nibbles = words if h == 0 else T.shift_right(words, _const(4))
        idx = T.reinterpret(T.bitwise_or(T.bitwise_and(nibbles, _const(0x0F0F0F0F)), _const(0x30201000)),
                            dtype="int8x64")
        for part in range(PARTS):
            looked_up[part].append(T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx512.permvar.qi.512"),
                A.vload([h, part, 0, 0], "int8x64"), idx, dtype="int8x64"))
    acc = C.vload([0], f"int32x{COLS}")
    for part in range(PARTS):
        acc = _vpdpbusd(COLS, acc, scale[part], looked_up[part][0] + looked_up[part][1])
    store = tirx.BufferStore(C, acc, [tirx.Ramp(tirx.const(0, "int32"), 1, COLS)])
    body = tirx.SeqStmt([_prefetch_line(W[prefetch]), store]) if prefetch else store
    return desc, _with_block_body(skeleton, body)


_VARIANT = re.compile(r"qtvm_bcq_nib8_i32x16_avx512vnni_pf(\d+)")


def register_variants(text: str) -> None:
    """Register the prefetch variants named in ``text`` (a tuning database's records)."""
    for words in set(_VARIANT.findall(text)):
        intrin_name(int(words))


intrin_name()
