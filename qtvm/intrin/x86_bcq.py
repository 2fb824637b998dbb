"""x86 TensorIntrin of the nibble-table int8 BCQ GEMV (``qtvm.bcq_a8_gemv``).

``qtvm_bcq_nib8_i32x16_avx512vnni``: for one 32-row block of one binary plane and 16 columns
(their 16 int32 words) and the block's 4 int8 tables of 64 bytes (nibble half h x part
(xl, xh) x 4 quads x 16 entries), add to each column's int32 its signed sum sum_k xq_k s_k
over the block. Indices: the low nibbles of the words' bytes with the byte position in bits
4-5 (``(w & 0x0F0F0F0F) | 0x30201000``, LLVM's ``vpternlogd``), and the same of ``w >> 4``
for the high nibbles; ``vpermb`` reads only bits 0-5 of an index. Per half, the xl table's
bytes are dotted with u8 ones and the xh table's with u8 sixteens (``vpdpbusd``), in two
chains. Each call prefetches the bit stream a distance ahead (one 64-byte line per call), as
the int16-table lookup does.
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
    chains = [C.vload([0], f"int32x{COLS}"), T.broadcast(T.int32(0), COLS)]
    for h in range(HALVES):
        nibbles = words if h == 0 else T.shift_right(words, _const(4))
        idx = T.reinterpret(T.bitwise_or(T.bitwise_and(nibbles, _const(0x0F0F0F0F)), _const(0x30201000)),
                            dtype="int8x64")
        for part in range(PARTS):
            entries = T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id("llvm.x86.avx512.permvar.qi.512"),
                                              A.vload([h, part, 0, 0], "int8x64"), idx, dtype="int8x64")
            chains[part] = _vpdpbusd(COLS, chains[part], scale[part], entries)
    store = tirx.BufferStore(C, chains[0] + chains[1], [tirx.Ramp(tirx.const(0, "int32"), 1, COLS)])
    body = tirx.SeqStmt([_prefetch_line(W[prefetch]), store]) if prefetch else store
    return desc, _with_block_body(skeleton, body)


_VARIANT = re.compile(r"qtvm_bcq_nib8_i32x16_avx512vnni_pf(\d+)")


def register_variants(text: str) -> None:
    """Register the prefetch variants named in ``text`` (a tuning database's records)."""
    for words in set(_VARIANT.findall(text)):
        intrin_name(int(words))


intrin_name()
