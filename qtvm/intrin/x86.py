"""x86 unpack-and-dot TensorIntrins for int8-activation kernels.

``qtvm_dot_u{b}s8_i32x16_{isa}`` (the GEMV step): for one block of 32 weights of 16
columns (one 64-byte line of each of the ``b`` packed int32 rows of a column-blocked
array: one zmm, or two ymm) and the block's 32 int8 activations, accumulate
sum_j x[j] * code_j into int32 -- the accumulators stay in registers for the block.
``qtvm_gemm_u{b}s8_...`` is the prefill register tile (rows x vectors).

Codes are unpacked by byte planes. A *unit* is 4 values of a column in the
4 bytes of one int32 lane; unit u holds values 4u..4u+3 (byte i: 4u+i) for every width,
so the activations stay in their natural order (``ops.quantize_activations_func`` reads
and writes them contiguously: 2.8 -> 1.2 us at K = 4096, where a per-value permutation
into the plain packing's order cost a scalar load each). ``byte_plane_words`` re-lays
the weights at compile time:
  b = 2, 4: unit (word w, plane p) = (W[w] >> b*p) & mask-per-byte: value j of the
            block sits in word j // (32/b), byte j % 4, plane (j // 4) % (8/b) (the
            plain packing puts value j of a word at bits [b*j, b*j + b): a shuffle of
            fields within each word, ``byte_plane_words``).
  b = 3:    ``pack_byte_planes`` re-lays QIGen's 3-word run at compile time into
            the same 32 values in 3 words, unit u = values 4u..4u+3 (byte i: 4u+i)
            in word u % 3 at bit 3 * (u // 3) of each byte: units 0-5 whole (3 bits),
            units 6 and 7 their low 2 bits (bits 6-7 of words 0, 1), their high bits
            at bits 6 and 7 of word 2. Units 0-5 are one mask each (3-5 in place: 8 x
            code, still a u8, shifted back once per block as the 4-bit high nibbles
            are); units 6 and 7 take two shifts, a mask and a ternary op. Still 3
            bits per weight (the 2-bit planes + high-bit word this replaced took
            28 unpack instructions per block, 12 of them shifts; now 14, 4).
The 4 activations of unit u are values 4u..4u+3, so each unit's activations are one
broadcast int32. The dot per ISA (``_block_dot``):
``vpdpbusd`` (AVX-512 VNNI, AVX-VNNI) with fields not at bit 0 masked in place (no
shift), or ``vpmaddubsw`` into int16 sums and one ``vpmaddwd`` per block (AVX2,
AVX-512BW); codes are the unsigned operand. Each step prefetches its lines a
distance ahead (a knob: ``intrin_name(..., prefetch)``; a hint: past the end of
the array it reads nothing and cannot fault).
"""
from __future__ import annotations

import re

import numpy as np
from tvm import s_tir, tirx
from tvm.script import tirx as T

BLOCK = 32  # weights (and activations) per intrinsic call, per column
BITS = (2, 3, 4)  # codes the byte-plane unpack handles
GFNI_BITS = (2, 3)  # widths with fields above bit 0 that a GFNI target unpacks by vgf2p8affineqb

# Default software prefetch of the weight stream, in rows of the column-blocked array:
# 24 rows of a 64-column int32 block = 6 KiB ahead, into L2 (prefetcht1). Measured
# on the Intel Xeon VM (int4-g128 4096x4096 from DRAM): no prefetch 59% of the read
# bandwidth, 2 KiB into L1 65-74%, 4-8 KiB into L2 77-79%. Other CPUs differ (Zen 5:
# 4 KiB into L1 is best): the schedule takes the distance from the target's facts or
# from tuning (``schedules.x86.a8_prefetch``) and names a variant of the step.
PREFETCH_ROWS = 24
PREFETCH_LOCALITY = 2  # llvm.prefetch locality: 3 = prefetcht0, 2 = prefetcht1 (L2)

ISAS = {  # isa -> int32 lanes of one vector, widest first (``schedules.x86.dot_isa`` picks)
    "avx512vnni": 16,
    "avx512bw": 16,
    "avxvnni": 8,  # VEX-encoded vpdpbusd on ymm (Alder Lake, Zen 5 without AVX-512 ...)
    "avx2": 8,
}
ISA_DOT = {"avx512vnni": "vpdpbusd", "avx512bw": "vpmaddubsw", "avxvnni": "vpdpbusd", "avx2": "vpmaddubsw"}
STEP_COLS = 16  # columns of one GEMV step: one 64-byte line of int32 words


def _int3_place(u, byte):
    """Where unit u's code sits in ``byte`` of a block: (word, bit, mask) of its low bits and
    (bit, mask) of its high bit in word 2 (mask 0: units 0-5 are whole). Arithmetic only, so
    the same definition serves ints (packing) and TIR (``block_code``: no Select, which would
    widen the words a block reads past [0, 3) for tensorize)."""
    split = u // 6  # 1 for units 6 and 7
    return u % 3, 8 * byte + 3 * (u // 3), 7 >> split, 8 * byte + u, split


def _plane_shift(bits: int, j):
    """2/4-bit: the bit offset of value j (0..31) of a block in its word (``j // (32 / bits)``):
    byte j % 4, plane (j // 4) % (8 / bits). Ints or TIR."""
    return 8 * (j % 4) + bits * ((j // 4) % (8 // bits))


def block_code(bits: int, word, j):
    """The code of value j (0..31) of a block in byte-plane order, ``word(t)`` its t-th int32 word (TIR)."""
    if bits != 3:
        return tirx.bitwise_and(tirx.shift_right(word(j // (32 // bits)), _plane_shift(bits, j)), (1 << bits) - 1)
    t, bit, mask, hi_bit, hi_mask = _int3_place(j // 4, j % 4)
    lo = tirx.bitwise_and(tirx.shift_right(word(t), bit), mask)
    hi = tirx.bitwise_and(tirx.shift_right(word(2), hi_bit), hi_mask)
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
            t, bit, mask, hi_bit, hi_mask = (np.uint64(v) for v in _int3_place(j // 4, j % 4))
            words[:, t] |= (blocks[:, j] & mask) << bit
            words[:, 2] |= ((blocks[:, j] >> np.uint64(2)) & hi_mask) << hi_bit
        else:
            words[:, j // (32 // bits)] |= blocks[:, j] << np.uint64(_plane_shift(bits, j))
    return words.reshape(kp // BLOCK * bits, n).astype(np.uint32).view(np.int32)


def byte_plane_words(words: np.ndarray, bits: int) -> np.ndarray:
    """2/4-bit words in the plain packing (value v of a word at bits [b*v, b*v + b)), any
    shape, -> the same words in byte-plane order: fields shuffled within each word, so a
    weight is re-laid in its packed size (``pack_byte_planes`` of its codes, without them)."""
    w = np.ascontiguousarray(words).view(np.uint32)
    out = np.zeros_like(w)
    mask = np.uint32((1 << bits) - 1)
    for v in range(32 // bits):
        out |= ((w >> np.uint32(bits * v)) & mask) << np.uint32(_plane_shift(bits, v))
    return out.view(np.int32)


def unpack_byte_planes(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack_byte_planes`` (numpy, for tests and references)."""
    rows, n = words.shape
    w = words.view(np.uint32).astype(np.uint64).reshape(rows // bits, bits, n)
    codes = np.empty((rows // bits, BLOCK, n), np.uint64)
    for j in range(BLOCK):
        if bits == 3:
            t, bit, mask, hi_bit, hi_mask = (np.uint64(v) for v in _int3_place(j // 4, j % 4))
            codes[:, j] = ((w[:, t] >> bit) & mask) | (((w[:, 2] >> hi_bit) & hi_mask) << np.uint64(2))
        else:
            codes[:, j] = (w[:, j // (32 // bits)] >> np.uint64(_plane_shift(bits, j))) & np.uint64((1 << bits) - 1)
    return codes.reshape(rows // bits * BLOCK, n).astype(np.uint32)


def intrin_name(bits: int, isa: str, prefetch=None, gfni: bool = False) -> str:
    """The GEMV step's name; ``prefetch`` (rows ahead, locality) other than the default
    names a variant (``_pf24l2``; ``_nopf`` for (0, 0)), as does ``gfni`` for the widths
    it changes (``_gfni``: ``GFNI_BITS``); variants are registered on first use."""
    return _variant(f"qtvm_dot_u{bits}s8_i32x{STEP_COLS}_{isa}", bits, prefetch, gfni,
                    lambda pf, g: _make(bits, isa, pf, g))


def _variant(base: str, bits: int, prefetch, gfni: bool, make) -> str:
    gfni = bool(gfni) and bits in GFNI_BITS
    pf = None
    if prefetch is not None and tuple(prefetch) != (PREFETCH_ROWS, PREFETCH_LOCALITY):
        pf = tuple(int(v) for v in prefetch)
    name = base + ("_gfni" if gfni else "") + ("" if pf is None else "_nopf" if pf[0] == 0 else f"_pf{pf[0]}l{pf[1]}")
    if gfni or pf is not None:
        _register(name, lambda: make(pf, gfni))
    return name


def _unit_codes(bits: int, W, lanes: int, col=0, in_place: bool = False, gfni: bool = False) -> list:
    """(code, shift) of the 8 units of one block (int32 x lanes, 4 codes a lane), in unit
    order, for the columns [col, col + lanes) of W: the unit's codes are ``code >> shift``.

    ``in_place`` (VNNI, whose dot takes u8 codes up to 255): units whose field does not
    start at bit 0 of the byte are masked where they sit (``w & 0xF0F0F0F0`` = 16 x code:
    4-bit high nibbles; ``w & 0x38383838`` = 8 x code: int3's odd whole units) instead of
    shifted down; their dots are shifted back once per block (``_block_dot``). Not int2:
    its planes at bits 2, 4, 6 need four chains, which spilled and measured no faster
    (40 instructions per block against 36; 35.7 against 36.5 GB/s cache-hot on EMR).
    ``gfni``: a field above bit 0 is moved down and masked by one ``vgf2p8affineqb`` (each
    byte times a bit matrix) instead of a shift and a mask (``_gf2_field``)."""
    const = lambda v: T.broadcast(T.int32(v - (1 << 32) if v >= 1 << 31 else v), lanes)  # noqa: E731

    def row(t):
        return W.vload([t, col], f"int32x{lanes}")

    def field(t, bit, width, keep_place=False):
        mask = ((1 << width) - 1) * 0x01010101
        if keep_place:
            return T.bitwise_and(row(t), const(mask << bit)), bit
        if gfni and bit:
            return _gf2_field(row(t), lanes, bit, width), 0
        w = T.shift_right(row(t), const(bit)) if bit else row(t)
        return T.bitwise_and(w, const(mask)), 0

    units = []
    for u in range(8):
        if bits == 3:
            t, bit, mask, hi_bit, split = _int3_place(u, 0)
            code, shift = field(t, bit, mask.bit_length(), in_place and not split)
            if split:  # the high bit, from bit u of word 2's bytes to bit 2
                code = T.bitwise_or(code, T.bitwise_and(T.shift_right(row(2), const(hi_bit - 2)), const(0x04040404)))
            units.append((code, shift))
        else:
            planes = 8 // bits
            units.append(field(u // planes, bits * (u % planes), bits, in_place and bits == 4 and u % 2 == 1))
    return units


def _gf2_field(word, lanes: int, bit: int, width: int):
    """Bits [bit, bit + width) of every byte of ``word`` moved to bit 0, the rest zero: one
    GF(2) affine transform (``vgf2p8affineqb``: output bit i of a byte is the parity of the
    byte AND matrix byte 7 - i), whose matrix row 7 - i selects input bit ``bit + i``."""
    matrix = sum((1 << (bit + i)) << (8 * (7 - i)) for i in range(width))
    matrix = T.reinterpret(T.broadcast(T.int64(matrix - (1 << 64) if matrix >= 1 << 63 else matrix), lanes // 2),
                          dtype=f"int8x{lanes * 4}")
    out = T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(f"llvm.x86.vgf2p8affineqb.{lanes * 32}"),
                                  T.reinterpret(word, dtype=f"int8x{lanes * 4}"), matrix, T.int8(0),
                                  dtype=f"int8x{lanes * 4}")
    return T.reinterpret(out, dtype=f"int32x{lanes}")


def _vpdpbusd(lanes: int, acc, code, x):
    """acc + the 4-byte dot of each lane of ``code`` (unsigned) with ``x`` (signed): AVX-512 VNNI."""
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(f"llvm.x86.avx512.vpdpbusd.{lanes * 32}"),
                                   acc, T.reinterpret(code, dtype=f"int8x{lanes * 4}"), x, dtype=f"int32x{lanes}")


def _maddubs(isa: str, lanes: int, code, x):
    """Pairwise u8 x s8 products summed into int16 (``vpmaddubsw``; no saturation for
    codes < 16 and |x| <= 127: 2 * 15 * 127 = 3810)."""
    name = "llvm.x86.avx512.pmaddubs.w.512" if lanes == 16 else "llvm.x86.avx2.pmadd.ub.sw"
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(name), T.reinterpret(code, dtype=f"int8x{lanes * 4}"),
                                   x, dtype=f"int16x{lanes * 2}")


def _pairs_to_i32(isa: str, lanes: int, pairs):
    """int16 pairs -> their int32 sums (``vpmaddwd`` by ones)."""
    name = "llvm.x86.avx512.pmaddw.d.512" if lanes == 16 else "llvm.x86.avx2.pmadd.wd"
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(name), pairs, T.broadcast(T.int16(1), lanes * 2),
                                   dtype=f"int32x{lanes}")


def _block_dot(isa: str, lanes: int, units: list, xs: list, chains: int = 2):
    """The int32 dot of one 32-value block, from zero, with the fewest instructions per ISA;
    ``units``: (code, shift) from ``_unit_codes``.

    VNNI: one ``vpdpbusd`` per unit, one dependency chain per shift (in-place units: the
    chain holds 2^shift x its dot, shifted back once: exact, as it is a multiple); where all
    units share a shift, ``chains`` chains (2: even / odd units; a register tile has the
    parallelism already and takes 1).
    AVX2 / AVX-512BW: ``vpmaddubsw`` per unit into two int16 chains, then one
    ``vpmaddwd`` per block (8 units x 3810 = 30480 fits int16 for codes < 16), instead
    of a ``vpmaddwd`` + add per unit."""
    if ISA_DOT[isa] == "vpdpbusd":
        split = len({shift for _, shift in units}) == 1  # one shift: split into ``chains``
        accs = {}  # (shift, chain) -> accumulator
        for u, ((code, shift), x) in enumerate(zip(units, xs)):
            key = (shift, u % chains if split else 0)
            accs[key] = _vpdpbusd(lanes, accs.get(key, T.broadcast(T.int32(0), lanes)), code, x)
        total = None
        for (shift, _), acc in sorted(accs.items()):
            term = T.shift_right(acc, T.broadcast(T.int32(shift), lanes)) if shift else acc
            total = term if total is None else total + term
        return total
    assert all(shift == 0 for _, shift in units), "vpmaddubsw takes unit codes < 16"
    sums = [None, None]
    for u, ((code, _), x) in enumerate(zip(units, xs)):
        pair = _maddubs(isa, lanes, code, x)
        sums[u % 2] = pair if sums[u % 2] is None else sums[u % 2] + pair
    return _pairs_to_i32(isa, lanes, sums[0] + sums[1])


def _acts(lanes: int, load4):
    """A unit's 4 activations (``load4()``: int8x4), broadcast to every lane."""
    return T.reinterpret(T.broadcast(T.reinterpret(load4(), dtype="int32"), lanes), dtype=f"int8x{lanes * 4}")


def _prefetch(W, t, col=0, prefetch=None):
    rows, locality = prefetch or (PREFETCH_ROWS, PREFETCH_LOCALITY)
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(W[rows + t, col]),
                              T.int32(0), T.int32(locality), T.int32(1))


def _make(bits: int, isa: str, prefetch=None, gfni: bool = False):
    """The GEMV step: one 32-value block of ``STEP_COLS`` columns (one 64-byte line of each
    weight row: one zmm, or two ymm), so each call prefetches each line it will need once.

    C is an ordinary (global-scope) buffer: TVM lowers a small global allocation to a stack
    ``alloca`` that LLVM keeps in registers, where a "local" one becomes a
    ``TVMBackendAllocWorkspace`` buffer that every block stores to and reloads.
    ``prefetch``: (rows ahead, llvm.prefetch locality), (0, 0) for none, None = default."""
    lanes, cols = ISAS[isa], STEP_COLS
    i32v = f"int32x{lanes}"

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, w: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (BLOCK,), "int8", offset_factor=1)
        W = T.match_buffer(w, (bits, cols), "int32", offset_factor=1)
        C = T.match_buffer(c, (cols,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:cols], A[0:BLOCK], W[0:bits, 0:cols])
            T.writes(C[0:cols])
            for i, j in T.grid(cols, BLOCK):
                with T.sblock("update"):
                    vi, vj = T.axis.remap("SR", [i, j])
                    C[vi] = C[vi] + T.Cast("int32", A[vj]) * _code_at(bits, W, vi, vj)

    @T.prim_func(s_tir=True)
    def skeleton(a: T.handle, w: T.handle, c: T.handle) -> None:
        s0 = T.int64()
        A = T.match_buffer(a, (BLOCK,), "int8", offset_factor=1)
        W = T.match_buffer(w, (bits, cols), "int32", offset_factor=1, strides=[s0, 1])
        C = T.match_buffer(c, (cols,), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:cols], A[0:BLOCK], W[0:bits, 0:cols])
            T.writes(C[0:cols])
            T.evaluate(0)  # replaced below

    A, W, C = skeleton.params
    stmts = [] if prefetch == (0, 0) else [tirx.Evaluate(_prefetch(W, t, 0, prefetch)) for t in range(bits)]
    xs = [_acts(lanes, lambda u=u: A.vload([u * 4], "int8x4")) for u in range(8)]
    in_place = ISA_DOT[isa] == "vpdpbusd"
    for v in range(cols // lanes):
        total = _block_dot(isa, lanes, _unit_codes(bits, W, lanes, v * lanes, in_place, gfni), xs)
        ramp = tirx.Ramp(tirx.const(v * lanes, "int32"), 1, lanes)
        stmts.append(tirx.BufferStore(C, C.vload([v * lanes], i32v) + total, [ramp]))
    return desc, _with_block_body(skeleton, stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts))


def _make_tile(bits: int, isa: str, rows: int, vecs: int, prefetch=None):
    """The prefill step: a ``rows`` x (``vecs`` vectors) register tile; each unit of each
    column vector is unpacked once and dotted with every row (QIGen's micro-GEMV tile:
    rows broadcasts + vecs codes + rows * vecs accumulators fit the registers).

    Every tile sum is bound (``Bind``) before any store to C: where C is a workspace buffer
    (an output tile over TVM's 1024-byte stack limit), LLVM cannot prove it distinct from
    W, and a store between two W loads would force the loads and unpacks to be redone."""
    lanes = ISAS[isa]
    cols, i32v = lanes * vecs, f"int32x{lanes}"

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, w: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (rows, BLOCK), "int8", offset_factor=1)
        W = T.match_buffer(w, (bits, cols), "int32", offset_factor=1)
        C = T.match_buffer(c, (rows, cols), "int32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:rows, 0:cols], A[0:rows, 0:BLOCK], W[0:bits, 0:cols])
            T.writes(C[0:rows, 0:cols])
            for r, i, j in T.grid(T.int64(rows), cols, BLOCK):  # rows: an int64 loop of the symbolic M
                with T.sblock("update"):
                    vr, vi, vj = T.axis.remap("SSR", [r, i, j])
                    C[vr, vi] = C[vr, vi] + T.Cast("int32", A[vr, vj]) * _code_at(bits, W, vi, vj)

    @T.prim_func(s_tir=True)
    def skeleton(a: T.handle, w: T.handle, c: T.handle) -> None:
        sa, s0, sc = T.int64(), T.int64(), T.int64()
        A = T.match_buffer(a, (rows, BLOCK), "int8", offset_factor=1, strides=[sa, 1])
        W = T.match_buffer(w, (bits, cols), "int32", offset_factor=1, strides=[s0, 1])
        C = T.match_buffer(c, (rows, cols), "int32", offset_factor=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(C[0:rows, 0:cols], A[0:rows, 0:BLOCK], W[0:bits, 0:cols])
            T.writes(C[0:rows, 0:cols])
            T.evaluate(0)  # replaced below

    A, W, C = skeleton.params
    lines = [v for v in range(vecs) if v * lanes * 4 % 64 == 0]  # one prefetch per 64-byte line
    stmts = [] if prefetch == (0, 0) else [tirx.Evaluate(_prefetch(W, t, v * lanes, prefetch))
                                           for t in range(bits) for v in lines]
    codes = [_unit_codes(bits, W, lanes, v * lanes) for v in range(vecs)]
    sums = {}
    for r in range(rows):
        xs = [_acts(lanes, lambda u=u: A.vload([r, u * 4], "int8x4")) for u in range(8)]
        for v in range(vecs):
            sums[r, v] = tirx.Var(f"tile_{r}_{v}", i32v)
            stmts.append(tirx.Bind(sums[r, v], _block_dot(isa, lanes, codes[v], xs, chains=1)))
    for (r, v), total in sums.items():
        col = tirx.Ramp(tirx.const(v * lanes, "int64"), tirx.const(1, "int64"), lanes)
        stmts.append(tirx.BufferStore(C, C.vload([r, v * lanes], i32v) + total, [tirx.const(r, "int64"), col]))
    return desc, _with_block_body(skeleton, tirx.SeqStmt(stmts))


def _with_block_body(func, body):
    """``func`` with its root block's body replaced."""
    realize = func.body
    block = realize.block
    new_block = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body, block.init,
                             block.alloc_buffers, block.match_buffers, block.annotations)
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, new_block))


# Register tiles of the prefill intrinsic, per ISA: rows x vectors of int32 accumulators.
# One call's columns are the prefill's output tile (``schedules.x86.prefill_tile_cols``):
# its dots and float partials fit the registers beside the codes. AVX-512: 4 x 2 (4 x 4 in
# a 64-column tile kept them in memory, 1.6x slower on Zen 4). pmaddubsw + pmaddwd need two
# temporaries per dot: AVX2 4 x 1 (4 x 2 spilled, checked in asm).
ROW_TILE = 4
TILE_VECS = {"avx512vnni": 2, "avx512bw": 2, "avxvnni": 2, "avx2": 1}


def tile_cols(isa: str) -> int:
    """Columns of one call of the prefill tile."""
    return ISAS[isa] * TILE_VECS[isa]


def tile_intrin_name(bits: int, isa: str, prefetch=None) -> str:
    """The prefill tile's name; ``prefetch`` as in ``intrin_name``. No GFNI variant: the tile
    unpacks each unit once for 4 rows, and with ``vgf2p8affineqb`` it measured 1.44x slower
    (int2 and int3, M = 16, 4096^2, EMR: 3.6 against 2.5 ms; not investigated: the 16
    accumulators leave few registers for its matrices, a likely cause)."""
    return _variant(f"qtvm_gemm_u{bits}s8_i32x{ISAS[isa]}_{ROW_TILE}x{TILE_VECS[isa]}_{isa}", bits, prefetch, False,
                    lambda pf, g: _make_tile(bits, isa, ROW_TILE, TILE_VECS[isa], pf))


def _register(name: str, make) -> None:
    try:
        s_tir.TensorIntrin.get(name)
    except Exception:  # not registered yet
        s_tir.TensorIntrin.register(name, *make())


_VARIANT = re.compile(r"qtvm_(dot|gemm)_u([234])s8_i32x\d+(?:_\dx\d)?_(avx512vnni|avx512bw|avxvnni|avx2)"
                      r"(_gfni)?(?:_(nopf|pf(\d+)l(\d)))?")


def register_variants(text: str) -> None:
    """Register the variants named in ``text`` (a tuning database's records name the
    TensorIntrins their traces tensorize with; replaying needs them registered)."""
    for kind, bits, isa, gfni, pf, rows, locality in set(_VARIANT.findall(text)):
        prefetch = None if not pf else (0, 0) if pf == "nopf" else (int(rows), int(locality))
        if kind == "dot":
            intrin_name(int(bits), isa, prefetch, bool(gfni))
        else:
            tile_intrin_name(int(bits), isa, prefetch)


def register_all() -> None:
    for bits in BITS:
        for isa in ISAS:
            _register(intrin_name(bits, isa), lambda: _make(bits, isa))
            _register(tile_intrin_name(bits, isa), lambda: _make_tile(bits, isa, ROW_TILE, TILE_VECS[isa]))


register_all()
