"""x86 unpack-and-dot TensorIntrins for int8-activation kernels.

``qtvm_dot_u{b}s8_i32x{lanes}_{isa}``: for one block of 32 weights of
``lanes`` columns (``b`` packed int32 words per column, rows of a column-blocked
array) and the block's 32 int8 activations, accumulate sum_j x[j] * code_j
into int32 -- the int32 accumulator stays in a register for the whole block.

Codes are unpacked by byte planes. A *unit* is 4 values of a column in the
4 bytes of one int32 lane:
  b = 2, 4: unit (word w, plane p) = (W[w] >> b*p) & mask-per-byte: byte i holds
            value w*(32/b) + i*(8/b) + p; this is the plain packing (value j of
            a word at bits [b*j, b*j + b)), so 2/4-bit weights need no relayout.
  b = 3:    ``pack_byte_planes`` re-lays QIGen's 3-word run at compile time into
            the same 32 values in 3 words: words 0-1 hold the low 2 bits of
            values 0-15 / 16-31 as 2-bit planes, word 2 their high bits, placed
            so that one shift puts unit u's high bits at bit 2 of each byte:
            code = lo | hi, still 3 bits per weight, 8 units per block.
The 4 activations of unit u sit at positions 4u..4u+3 (``act_position``), so
each unit's activations are one broadcast int32. The dot is ``vpdpbusd``
(VNNI) or ``pmaddubsw`` + ``pmaddwd`` (AVX2/AVX-512BW): codes are the
unsigned operand. Each call prefetches the rows ``PREFETCH_ROWS`` ahead
(a hint: past the end of the array it reads nothing and cannot fault).
"""
from __future__ import annotations

import numpy as np
from tvm import s_tir, tirx
from tvm.script import tirx as T

BLOCK = 32  # weights (and activations) per intrinsic call, per column
BITS = (2, 3, 4)  # codes the byte-plane unpack handles

# Software prefetch of the weight stream, in rows of the column-blocked array:
# 24 rows of a 64-column int32 block = 6 KiB ahead, into L2 (prefetcht1).
# Measured from DRAM (int4-g128 4096x4096, interleaved rounds, % of the read
# bandwidth probed in the same rounds): no prefetch 59%, 2 KiB into L1
# (prefetcht0) 65-74%, 4-8 KiB into L2 77-79% at 1 and 2 threads; into L1 the
# prefetches hold line-fill buffers that the demand loads need.
PREFETCH_ROWS = 24
PREFETCH_LOCALITY = 2  # llvm.prefetch locality: 3 = prefetcht0, 2 = prefetcht1 (L2)

ISAS = {  # isa -> int32 lanes of one vector
    "avx512vnni": 16,
    "avx512bw": 16,
    "avx2": 8,
}


def _plane_bits(bits: int) -> int:
    """Bits of the plane-packed part of a code (3-bit codes: their 2 low bits)."""
    return 2 if bits == 3 else bits


def act_position(bits: int, j):
    """Value j (0..31) of a block -> its activation position 4 * unit + byte (TIR or int)."""
    pb = _plane_bits(bits)
    vpw, planes = 32 // pb, 8 // pb
    unit = (j // vpw) * planes + (j % vpw) % planes
    return unit * 4 + (j % vpw) // planes


def act_value(bits: int, q):
    """Activation position q (0..31) -> value index j within a block (inverse of act_position)."""
    pb = _plane_bits(bits)
    vpw, planes = 32 // pb, 8 // pb
    unit, byte = q // 4, q % 4
    return (unit // planes) * vpw + byte * planes + unit % planes


def _int3_high_bit(j):
    """Bit of word 2 holding the high bit of value j: byte (j % 16) // 4, bit = unit."""
    return 8 * ((j % 16) // 4) + 4 * (j // 16) + j % 4


def block_code(bits: int, word, j):
    """The code of value j (0..31) of a block, ``word(t)`` its t-th int32 word (TIR)."""
    if bits != 3:
        vpw = 32 // bits
        return tirx.bitwise_and(tirx.shift_right(word(j // vpw), (j % vpw) * bits), (1 << bits) - 1)
    lo = tirx.bitwise_and(tirx.shift_right(word(j // 16), (j % 16) * 2), 3)
    hi = tirx.bitwise_and(tirx.shift_right(word(2), _int3_high_bit(j)), 1)
    return tirx.bitwise_or(lo, tirx.shift_left(hi, 2))


def _code_at(bits: int, W, col, j):
    return block_code(bits, lambda t: W[t, col], j)


def pack_byte_planes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[K_pad, N] codes (K_pad a multiple of 32) -> [K_pad * bits / 32, N] int32 words."""
    kp, n = codes.shape
    blocks = codes.astype(np.uint64).reshape(kp // BLOCK, BLOCK, n)
    words = np.zeros((kp // BLOCK, bits, n), np.uint64)
    for j in range(BLOCK):
        if bits == 3:
            words[:, j // 16] |= (blocks[:, j] & np.uint64(3)) << np.uint64(2 * (j % 16))
            words[:, 2] |= (blocks[:, j] >> np.uint64(2)) << np.uint64(_int3_high_bit(j))
        else:
            vpw = 32 // bits
            words[:, j // vpw] |= blocks[:, j] << np.uint64(bits * (j % vpw))
    return words.reshape(kp // BLOCK * bits, n).astype(np.uint32).view(np.int32)


def unpack_byte_planes(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack_byte_planes`` (numpy, for tests and references)."""
    rows, n = words.shape
    w = words.view(np.uint32).astype(np.uint64).reshape(rows // bits, bits, n)
    codes = np.empty((rows // bits, BLOCK, n), np.uint64)
    for j in range(BLOCK):
        if bits == 3:
            lo = (w[:, j // 16] >> np.uint64(2 * (j % 16))) & np.uint64(3)
            codes[:, j] = lo | (((w[:, 2] >> np.uint64(_int3_high_bit(j))) & np.uint64(1)) << np.uint64(2))
        else:
            vpw = 32 // bits
            codes[:, j] = (w[:, j // vpw] >> np.uint64(bits * (j % vpw))) & np.uint64((1 << bits) - 1)
    return codes.reshape(rows // bits * BLOCK, n).astype(np.uint32)


def intrin_name(bits: int, isa: str) -> str:
    return f"qtvm_dot_u{bits}s8_i32x{ISAS[isa]}_{isa}"


def _unit_codes(bits: int, W, lanes: int) -> list:
    """The 8 unit vectors (int32 x lanes, 4 codes a lane) of one block, in unit order."""
    vec = f"int32x{lanes}"
    const = lambda v: T.broadcast(T.int32(v), lanes)  # noqa: E731

    def row(t):
        return W.vload([t, 0], vec)

    units = []
    for u in range(8):
        if bits == 3:
            lo = T.bitwise_and(T.shift_right(row(u // 4), const(2 * (u % 4))), const(0x03030303))
            # High bits of unit u sit at bit u of each byte: move them to bit 2.
            h = row(2)
            h = T.shift_right(h, const(u - 2)) if u >= 2 else T.shift_left(h, const(2 - u))
            units.append(T.bitwise_or(lo, T.bitwise_and(h, const(0x04040404))))
        else:
            planes, mask = 8 // bits, ((1 << bits) - 1) * 0x01010101
            w = row(u // planes)
            shift = bits * (u % planes)
            units.append(T.bitwise_and(T.shift_right(w, const(shift)) if shift else w, const(mask)))
    return units


def _make(bits: int, isa: str):
    lanes = ISAS[isa]
    vbits = lanes * 32
    i32v, i8v, i16v = f"int32x{lanes}", f"int8x{lanes * 4}", f"int16x{lanes * 2}"

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, w: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (BLOCK,), "int8", offset_factor=1)
        W = T.match_buffer(w, (bits, lanes), "int32", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "int32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:BLOCK], W[0:bits, 0:lanes])
            T.writes(C[0:lanes])
            for i, j in T.grid(lanes, BLOCK):
                with T.sblock("update"):
                    vi, vj = T.axis.remap("SR", [i, j])
                    C[vi] = C[vi] + T.Cast("int32", A[act_position(bits, vj)]) * _code_at(bits, W, vi, vj)

    def acts(A, u):
        """Unit u's 4 activations, broadcast to every lane."""
        return T.reinterpret(T.broadcast(T.reinterpret(A.vload([u * 4], "int8x4"), dtype="int32"), lanes), dtype=i8v)

    def dot(acc, code, x):
        if isa == "avx512vnni":
            return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(f"llvm.x86.avx512.vpdpbusd.{vbits}"),
                                           acc, T.reinterpret(code, dtype=i8v), x, dtype=i32v)
        maddubs = "llvm.x86.avx512.pmaddubs.w.512" if isa == "avx512bw" else "llvm.x86.avx2.pmadd.ub.sw"
        maddwd = "llvm.x86.avx512.pmaddw.d.512" if isa == "avx512bw" else "llvm.x86.avx2.pmadd.wd"
        pairs = T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(maddubs), T.reinterpret(code, dtype=i8v), x,
                                        dtype=i16v)
        return acc + T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(maddwd), pairs,
                                             T.broadcast(T.int16(1), lanes * 2), dtype=i32v)

    def prefetch(W, t):
        return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(W[PREFETCH_ROWS + t, 0]),
                                  T.int32(0), T.int32(PREFETCH_LOCALITY), T.int32(1))

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, w: T.handle, c: T.handle) -> None:
        s0 = T.int64()
        A = T.match_buffer(a, (BLOCK,), "int8", offset_factor=1)
        W = T.match_buffer(w, (bits, lanes), "int32", offset_factor=1, strides=[s0, 1])
        C = T.match_buffer(c, (lanes,), "int32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:BLOCK], W[0:bits, 0:lanes])
            T.writes(C[0:lanes])
            for t in range(bits):
                T.evaluate(prefetch(W, t))
            acc = T.meta_var(_accumulate(C.vload([0], i32v), _unit_codes(bits, W, lanes), [acts(A, u) for u in range(8)], dot, lanes))
            C[T.ramp(T.int32(0), 1, lanes)] = acc

    return desc, impl


def _accumulate(acc, codes, xs, dot, lanes: int):
    """Even units into ``acc``, odd units into a second accumulator, summed at the end:
    two dependency chains of vpdpbusd instead of one (measured 73% -> 80% of the
    DRAM bandwidth at 2 threads, int4-g128 4096x4096)."""
    chains = [acc, T.broadcast(T.int32(0), lanes)]
    for u, (code, x) in enumerate(zip(codes, xs)):
        chains[u % 2] = dot(chains[u % 2], code, x)
    return chains[0] + chains[1]


def register_all() -> None:
    for bits in BITS:
        for isa in ISAS:
            name = intrin_name(bits, isa)
            try:
                s_tir.TensorIntrin.get(name)
            except Exception:  # not registered yet
                s_tir.TensorIntrin.register(name, *_make(bits, isa))


register_all()
