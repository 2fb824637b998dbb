"""Decode GEMV rule for GPU targets (CUDA, OpenCL): the ``qmatmul`` compute.

The compute (``qtvm.ops.qmatmul_func`` with ``chunk``) sums, per chunk c of K,
``coef[g(c)] * sum_{k in c} x_k decode(k) + offset[g(c)] * sum_{k in c} x_k``. Here:

    grid   (ceil(N / (warps * cols)), M)        one block row per activation row
    block  (lanes, warps)                       lanes split K, each warp owns ``cols`` columns
    per lane, for each of its chunks c = co * lanes + lane:
        w[cols, words] = the chunk's packed words of each column      (128-bit loads)
        P[cols] = sum over the chunk's values of x_k * decode(w)       (unrolled, x_k in a register
                                                                        is used by every column)
        X = sum of the chunk's x_k
        acc_rf[cols] += coef * P + offset * X
    then acc[cols] = sum over lanes of acc_rf   (a cross-thread reduction: warp shuffles on
    CUDA, then shared memory where the lanes span several warps; local memory on OpenCL),
    and y = acc.

Consecutive lanes read consecutive chunks of one column, so a warp's loads of a column
are one contiguous run, and so are its loads of x when a lane's chunk is short (CUDA:
16 values, 64 bytes of x a lane; with 32-value chunks the lanes' x loads were 128 bytes
apart, 32 cache lines an instruction, and L1 the limit on an H100). With one stored
column per block (``col_block = 1``) a column's words start at a multiple of 16 (8)
bytes whenever the column's word rows are a multiple of 4 (2); the vector load is used
only then.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from qtvm import ops
from schedules import gpu


def schedule_qmatmul_gpu(func: tvm.tirx.PrimFunc, target: tvm.target.Target, *, lanes: int | None = None,
                         warps: int | None = None, cols: int | None = None,
                         x_bytes: int | None = None) -> s_tir.Schedule | None:
    """The analytic schedule; the keyword knobs (defaults from ``gpu.params``) are for tuning.
    Takes the exact fp32 kernel ("qmatmul") and the fp16-activation one ("qmatmul_f16",
    whose decoded run is one CUDA TensorIntrin on CUDA targets). ``x_bytes``: each lane
    loads its chunk of x into registers this many bytes at a time (0: value by value where
    used; a lane's chunk is contiguous, so scalar loads of a warp touch 32 lines each)."""
    desc = gemv_format(func, target)
    if desc is None:
        return None
    p = gpu.params(target)
    analytic = launch(desc, p)
    lanes, warps, cols = lanes or analytic["lanes"], warps or analytic["warps"], cols or analytic["cols"]
    sch = s_tir.Schedule(func)
    from qtvm.intrin import cuda

    apply_qmatmul_gpu(sch, desc, lanes=lanes, warps=warps, cols=cols,
                      intrinsics=cuda if target.kind.name == "cuda" else None,
                      x_vector=x_vector(desc, p.x_bytes if x_bytes is None else x_bytes))
    return sch


def launch(desc, p: "gpu.GpuParams") -> dict:
    """The analytic launch shape: ``p``'s, except for fp16 activations: half the columns
    (fp16 values take a 32-bit register each: 4 columns spilled on sm_80) and the lanes of
    one warp (32), the block's threads as groups on their own columns: with 128 lanes on K,
    ptxas (TVM's flags) spilled 4 bytes on sm_80 (int4, int8) and 18 on sm_90 (int2)."""
    if str(desc.get("activations", "fp32")) != "fp16":
        return {"lanes": p.lanes, "warps": p.warps, "cols": p.cols}
    lanes = min(p.lanes, 32)
    return {"lanes": lanes, "warps": max(p.warps, p.lanes // lanes), "cols": max(1, p.cols // 2)}


def x_vector(desc, x_bytes: int) -> int:
    """Activations per load for ``x_bytes``-wide loads of x (fp16: at most 16 bytes, as CUDA
    has no vector type of 16 halves)."""
    return min(x_bytes, 16) // 2 if str(desc.get("activations", "fp32")) == "fp16" else x_bytes // 4


def gemv_format(func: tvm.tirx.PrimFunc, target: tvm.target.Target):
    """The format description of a decode kernel this GEMV layout serves (the fp32 "qmatmul"
    and fp16 "qmatmul_f16" computes, and "qmatmul_experts", whose block row per activation row
    reads that row's expert; one column per stored block), else None."""
    if not any(gpu.applies(func, target, kind) for kind in ("qmatmul", "qmatmul_f16", "qmatmul_experts")):
        return None
    desc = func.attrs[ops.FORMAT_ATTR]
    return desc if int(desc["col_block"]) == 1 else None  # lanes walk each column's contiguous K run


def apply_qmatmul_gpu(sch: s_tir.Schedule, desc, *, lanes: int, warps: int, cols: int, intrinsics=None,
                      x_vector: int = 0) -> None:
    """``intrinsics``: the module of the target's fp16 unpack TensorIntrins (``qtvm.intrin.cuda``
    or ``.opencl``; None: the plain decode). ``x_vector``: load each chunk's activations into
    registers with loads of this many values (0: read where used)."""
    terms = int(desc["terms"])
    out, acc = sch.get_sblock(ops.BLOCK_OUT), sch.get_sblock(ops.BLOCK_ACC)
    xsum = sch.get_sblock(ops.BLOCK_XSUM)
    parts = [sch.get_sblock(ops.partial_block(t)) for t in range(terms)]
    f16 = str(desc.get("activations", "fp32")) == "fp16"
    if f16:  # each packed run decoded by one intrinsic: blockized first, so the lane split's
        decode_blocks = _decode_runs(sch, desc, intrinsics)  # tail guard lands on the run block

    # Lanes split the chunk loop; rf[lane, i, j] holds each lane's share of acc. A K of
    # at most ``lanes`` chunks gets one lane per chunk.
    chunks = int(desc["padded_k"]) // int(desc.get("chunk", desc["group"]))
    lanes = min(chunks, lanes)
    i, j, c = sch.get_loops(acc)
    co, lane = sch.split(c, [None, lanes])
    rf = sch.rfactor(lane, 0)
    i, j, co, lane = sch.get_loops(rf)
    jb, jw, jc = sch.split(j, [None, warps, cols])
    sch.reorder(i, jb, jw, lane, co, jc)
    sch.bind(i, "blockIdx.y")
    sch.bind(jb, "blockIdx.x")
    sch.bind(jw, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    sch.set_scope(rf, 0, "local")

    # Per chunk: the columns' packed words, the partial dot of every term, the x sum.
    for part in parts:
        sch.compute_at(part, co)
        sch.set_scope(part, 0, "local")
        p_cols, p_k = sch.get_loops(part)[-2:]
        if not f16:
            sch.reorder(p_k, p_cols)  # one x_k feeds every column
        sch.unroll(p_k)
        sch.unroll(p_cols)
    sch.compute_at(xsum, co)
    sch.set_scope(xsum, 0, "local")
    sch.unroll(sch.get_loops(xsum)[-1])
    if f16:
        # The chunk's fp16 activations in registers, then column by column: decode the
        # column's runs (one TensorIntrin each) and its half-precision dot.
        xh = sch.get_sblock(ops.BLOCK_XH)
        sch.compute_at(xh, co)
        sch.set_scope(xh, 0, "local")
        _vector_or_unroll(sch, xh, desc, x_vector)
        decode, words = decode_blocks
        sch.compute_at(decode, sch.get_loops(parts[0])[-2])
        _cache_weight_words(sch, [decode], co, desc, words)
        sch.unroll(sch.get_loops(decode)[-1])  # each value or run: registers take constant indices only
    else:
        _cache_weight_words(sch, parts, co, desc)
        if x_vector:
            xs = sch.cache_read(parts[0], "x", "local", consumer_blocks=[*parts, xsum])
            sch.compute_at(xs, co)
            _vector_or_unroll(sch, xs, desc, x_vector)
    sch.unroll(jc)

    # Cross-lane sum per column, then y.
    sch.reverse_compute_at(acc, jw)
    lane_sum, col = sch.get_loops(acc)[-2:]
    sch.reorder(col, lane_sum)
    sch.bind(lane_sum, "threadIdx.x")
    sch.set_scope(acc, 0, "local")
    sch.reverse_compute_at(out, jw)
    for loop in gpu.loops_below(sch, out, jw):
        sch.unroll(loop)
    for part in parts:
        sch.decompose_reduction(part, sch.get_loops(part)[-2])
    sch.decompose_reduction(xsum, sch.get_loops(xsum)[-1])
    if chunks % lanes == 0:
        sch.decompose_reduction(rf, co)
    # Else TVM cannot hoist the init out of a split with a tail (the bindings are not
    # affine); it stays as "if first chunk iteration: zero", which every lane runs,
    # since there are at least as many chunks as lanes.


def _cache_weight_words(sch: s_tir.Schedule, parts, co, desc, words=None) -> None:
    """The chunk's packed words of each column in registers, read with 128-bit loads where
    every column's run starts 16-byte aligned (word rows and words per chunk multiples of 4),
    else 64-bit loads where it starts 8-byte aligned (multiples of 2)."""
    name = "bits" if str(desc.get("family")) == "bcq" else "qweight"
    if words is None:
        words = sch.cache_read(parts[0], name, "local", consumer_blocks=parts)
    sch.compute_at(words, co)
    loops = sch.get_loops(words)
    chunk_words = int(desc.get("chunk", desc["group"])) * gpu.stored_bits(desc) // 32
    rows = int(desc["padded_k"]) * gpu.stored_bits(desc) // 32
    inner = loops[-1]
    whole_words = int(desc.get("chunk", desc["group"])) * gpu.stored_bits(desc) % 32 == 0
    width = next((w for w in (4, 2) if chunk_words % w == 0 and rows % w == 0), 1) if whole_words else 1
    if width > 1:  # 16- or 8-byte loads: every chunk of every column starts at a multiple of them
        _, vec = sch.split(inner, [None, width])
        sch.vectorize(vec)
    for loop in sch.get_loops(words)[-3:-1] if chunk_words > 4 else []:
        sch.unroll(loop)


def _vector_or_unroll(sch: s_tir.Schedule, block, desc, width: int) -> None:
    """The chunk's activations loaded ``width`` at a time where every chunk starts at a
    multiple of ``width`` inside x (no K padding to read around), else value by value."""
    chunk = int(desc.get("chunk", desc["group"]))
    inner = sch.get_loops(block)[-1]
    if width > 1 and chunk % width == 0 and int(desc["padded_k"]) == int(desc["k"]):
        outer, vec = sch.split(inner, [None, width])
        sch.vectorize(vec)
        sch.unroll(outer)
    else:
        sch.unroll(inner)


def _tensorized(desc, intrinsics) -> bool:
    from qtvm.intrin.runs import RUNS

    return intrinsics is not None and int(desc["chunk"]) % RUNS[str(desc["unpack"])][1] == 0


def _decode_runs(sch: s_tir.Schedule, desc, intrinsics):
    """The fp16 decode stage and its packed words, both in registers; each run decoded by
    one TensorIntrin of the target (CUDA: lop3/prmt/exponent-OR, ``qtvm.intrin.cuda``;
    OpenCL: as_half2 magic exponents, ``qtvm.intrin.opencl``) where chunks hold whole runs,
    else the plain decode. Returns (decode block, words block)."""
    from qtvm.intrin.runs import RUNS

    decode = sch.get_sblock(ops.BLOCK_DECODE)
    words = sch.cache_read(decode, "qweight", "local")
    sch.set_scope(decode, 0, "local")
    values = RUNS[str(desc["unpack"])][1]
    if _tensorized(desc, intrinsics):
        _, d_k = sch.get_loops(decode)
        run, run_values = sch.split(d_k, [None, values])
        sch.tensorize(run_values, intrinsics.intrin_name(str(desc["unpack"])))
        decode = sch.get_sblock(ops.BLOCK_DECODE + "_o")
    return decode, words
