"""x86 TensorIntrins of the 16-entry LUT GEMV (``qtvm.lut_gemv.lut16_gemv_func``).

``qtvm_lut16_f32x16_{isa}``: for one 32-row block of one binary plane and 16 columns
(their 16 int32 words) and the block's 8 tables of 16 floats, accumulate
sum_{c < 8} table_c[(word >> 4 c) & 15] per column. The lookup is ``vpermps``, which
reads only the low index bits of each lane, so the nibble needs one shift and no mask:
AVX-512 looks up 16 columns in one zmm table; AVX2's ``vpermps`` has 8 entries, so a
lookup is two of them blended on the index's bit 3. Exact fp32: a table entry is a sum
of 4 activations, the same sums the scalar LUT kernel reads. Each call prefetches the bit
stream ``PREFETCH_WORDS`` ahead: the kernel is a pure weight stream, and the hardware
prefetchers alone left it at 51-58% of the read bandwidth.
"""
from __future__ import annotations

import re

from tvm import tirx
from tvm.script import tirx as T

from qtvm.intrin.x86 import _register, _with_block_body

COLS, CHUNKS, TABLE = 16, 8, 16
ISAS = {"avx512": 16, "avx2": 8}  # isa -> fp32 lanes


def intrin_name(isa: str, prefetch: int | None = None) -> str:
    """The lookup's name, registered on first use; ``prefetch``: words ahead (None: the default)."""
    words = PREFETCH_WORDS if prefetch is None else prefetch
    name = f"qtvm_lut16_f32x{COLS}_{isa}" + ("" if words == PREFETCH_WORDS else f"_pf{words}")
    _register(name, lambda: _make(isa, words))
    return name


def _lookup(isa: str, lanes: int, table_lo, table_hi, idx):
    if isa == "avx512":
        return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id("llvm.x86.avx512.permvar.sf.512"), table_lo, idx,
                                       dtype=f"float32x{lanes}")
    perm = T.llvm_lookup_intrinsic_id("llvm.x86.avx2.permps")
    lo = T.call_llvm_pure_intrin(perm, table_lo, idx, dtype="float32x8")
    hi = T.call_llvm_pure_intrin(perm, table_hi, idx, dtype="float32x8")
    sign = T.reinterpret(T.shift_left(idx, T.broadcast(T.int32(28), 8)), dtype="float32x8")  # bit 3 -> sign
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id("llvm.x86.avx.blendv.ps.256"), lo, hi, sign,
                                   dtype="float32x8")


# Software prefetch of the bit stream (each call prefetches the line this many words
# ahead; a column block's rows are contiguous): 6 KiB, into L2. Measured on Zen 5 (bcq3-g128,
# one thread, weights DRAM-cold, in-process A/B, medians of 9): none / 4 / 6 / 8 KiB ahead:
# 4096x4096 373 / 279 / 271 / 270 us, 4096x11008 998 / 928 / 699 / 905, 11008x4096 1016 /
# 1006 / 1018 / 996 (level: at K = 6144, 11008, 22016 this kernel runs ~20 GB/s cold whatever
# the distance, docs/bench_gemv_zen5.md); 12 KiB ahead 460 us at 4096x4096.
PREFETCH_WORDS = 1536


def _prefetch_line(element):
    """prefetcht1 of ``element``'s line: a hint, so past the array's end is harmless."""
    return tirx.Evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(element), T.int32(0), T.int32(2),
                                            T.int32(1)))


def _make(isa: str, prefetch: int):
    lanes = ISAS[isa]

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, w: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (CHUNKS, TABLE), "float32", offset_factor=1)
        W = T.match_buffer(w, (COLS,), "int32", offset_factor=1)
        C = T.match_buffer(c, (COLS,), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:COLS], W[0:COLS], A[0:CHUNKS, 0:TABLE])
            T.writes(C[0:COLS])
            for j, ch, p in T.grid(COLS, CHUNKS, TABLE):
                with T.sblock("update"):
                    vj, vc, vp = T.axis.remap("SRR", [j, ch, p])
                    C[vj] = C[vj] + T.Select(T.bitwise_and(T.shift_right(W[vj], vc * 4), 15) == vp, A[vc, vp],
                                             T.float32(0))

    @T.prim_func(s_tir=True)
    def skeleton(a: T.handle, w: T.handle, c: T.handle) -> None:
        sa = T.int64()
        A = T.match_buffer(a, (CHUNKS, TABLE), "float32", offset_factor=1, strides=[sa, 1])
        W = T.match_buffer(w, (COLS,), "int32", offset_factor=1)
        C = T.match_buffer(c, (COLS,), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:COLS], W[0:COLS], A[0:CHUNKS, 0:TABLE])
            T.writes(C[0:COLS])
            T.evaluate(0)  # replaced below

    A, W, C = skeleton.params
    stmts = [_prefetch_line(W[prefetch])] if prefetch else []  # the call's 16 words: one line
    for v in range(COLS // lanes):
        words = W.vload([v * lanes], f"int32x{lanes}")
        chains = [C.vload([v * lanes], f"float32x{lanes}"), T.broadcast(T.float32(0), lanes)]
        for ch in range(CHUNKS):
            idx = words if ch == 0 else T.shift_right(words, T.broadcast(T.int32(4 * ch), lanes))
            lo = A.vload([ch, 0], f"float32x{lanes}")
            hi = A.vload([ch, 8], "float32x8") if isa == "avx2" else None
            chains[ch % 2] = chains[ch % 2] + _lookup(isa, lanes, lo, hi, idx)
        stmts.append(tirx.BufferStore(C, chains[0] + chains[1], [tirx.Ramp(tirx.const(v * lanes, "int32"), 1, lanes)]))
    return desc, _with_block_body(skeleton, stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts))


# -- int8 activations: int16 table pairs, one vpermw per two chunks (AVX-512BW) ------------
PAIRS = 4


def _make_a8(prefetch: int):
    """One 32-row block of one plane and 16 columns into their 32 int16 partials (column j's
    chunks 0-3 in half-word 2 j, chunks 4-7 in 2 j + 1: one register). The 16 words are 32
    half-words: after ``words >> 4 h`` the low half of column j's word holds nibble h, the
    high half nibble h + 4; ``& 0x000F000F | 0x00100000`` (one vpternlogd) makes them the
    indices of entries h and 16 + (h + 4) in table pair h, so one vpermw looks up both."""

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, w: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (PAIRS, 2, TABLE), "int16", offset_factor=1)
        W = T.match_buffer(w, (COLS,), "int32", offset_factor=1)
        C = T.match_buffer(c, (COLS, 2), "int16", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:COLS, 0:2], W[0:COLS], A[0:PAIRS, 0:2, 0:TABLE])
            T.writes(C[0:COLS, 0:2])
            for j, s, h, p in T.grid(COLS, 2, PAIRS, TABLE):
                with T.sblock("update"):
                    vj, vs, vh, vp = T.axis.remap("SSRR", [j, s, h, p])
                    C[vj, vs] = C[vj, vs] + T.Select(
                        T.bitwise_and(T.shift_right(W[vj], (vh + vs * 4) * 4), 15) == vp, A[vh, vs, vp], T.int16(0))

    @T.prim_func(s_tir=True)
    def skeleton(a: T.handle, w: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (PAIRS, 2, TABLE), "int16", offset_factor=1)
        W = T.match_buffer(w, (COLS,), "int32", offset_factor=1)
        C = T.match_buffer(c, (COLS, 2), "int16", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:COLS, 0:2], W[0:COLS], A[0:PAIRS, 0:2, 0:TABLE])
            T.writes(C[0:COLS, 0:2])
            T.evaluate(0)  # replaced below

    A, W, C = skeleton.params
    lanes16 = 2 * COLS
    words = W.vload([0], f"int32x{COLS}")
    low_nibbles = T.broadcast(T.int32(0x000F000F), COLS)
    high_pair = T.broadcast(T.int32(0x00100000), COLS)
    acc = C.vload([0, 0], f"int16x{lanes16}")
    for h in range(PAIRS):
        shifted = words if h == 0 else T.shift_right(words, T.broadcast(T.int32(4 * h), COLS))
        idx = T.reinterpret(T.bitwise_or(T.bitwise_and(shifted, low_nibbles), high_pair), dtype=f"int16x{lanes16}")
        acc = acc + T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id("llvm.x86.avx512.permvar.hi.512"),
                                            A.vload([h, 0, 0], f"int16x{lanes16}"), idx, dtype=f"int16x{lanes16}")
    store = tirx.BufferStore(C, acc, [tirx.const(0, "int32"), tirx.Ramp(tirx.const(0, "int32"), 1, lanes16)])
    body = tirx.SeqStmt([_prefetch_line(W[prefetch]), store]) if prefetch else store
    return desc, _with_block_body(skeleton, body)


# Its prefetch distance, words ahead: 4 KiB. Measured on Zen 5 (bcq3-g128, one thread,
# weights DRAM-cold, in-process A/B, medians of 9; 4096^2 / 4096x11008 / 11008x4096):
# none 266 / 748 / 736 us, 2 KiB 261 / 677 / 722, 3 KiB 250 / 666 / 696, 4 KiB 243 / 634 / 682,
# 6 KiB 263-282 / 755 / 753-806, 9-12 KiB ~300 / - / ~835. The fp32 kernel, slower per line,
# wants its lines further ahead.
A8_PREFETCH_WORDS = 1024


def register_a8(prefetch: int | None = None) -> str:
    """The int16 lookup's name, registered on first use; ``prefetch``: words ahead (None: the default)."""
    words = A8_PREFETCH_WORDS if prefetch is None else prefetch
    name = f"qtvm_lut16_i16x{2 * COLS}_avx512bw" + ("" if words == A8_PREFETCH_WORDS else f"_pf{words}")
    _register(name, lambda: _make_a8(words))
    return name


_VARIANT = re.compile(r"qtvm_lut16_(?:f32x16_(avx512|avx2)|i16x32_avx512bw)_pf(\d+)")


def register_variants(text: str) -> None:
    """Register the prefetch variants named in ``text`` (a tuning database's records name
    the TensorIntrins their traces tensorize with; replaying needs them registered)."""
    for isa, words in set(_VARIANT.findall(text)):
        if isa:
            intrin_name(isa, int(words))
        else:
            register_a8(int(words))
