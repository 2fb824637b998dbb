"""TE compute definitions of quantized matmuls; they never schedule.

``qmatmul`` computes y[M, N] = x[M, K] @ W for a symbolic M with W stored
column-blocked: every stored [rows, N] array of the format becomes
[ceil(N / nb), rows, nb] (``block_columns``), so a kernel that walks one block
of nb columns reads contiguous memory. Affine formats (w = scale * decode +
offset per group) use the grouped formula

    y[m, n] = sum_g scale[g, n] * P[m, g, n] + offset[g, n] * X[m, g]
    P[m, g, n] = sum_{k in g} x[m, k] * decode(k, n),   X[m, g] = sum_{k in g} x[m, k]

so the inner loop is unpack + one FMA and the group terms cost 1/g of it.
A format may decode a weight into several terms (BCQ: one per binary plane):
w = sum_t coef_t * decode_t + offset, one partial stage per term.
No float copy of W exists at any point.

The format contract (see ``qtvm.formats.base.QuantFormat``):
  array_rows(k) -> {name: rows}      stored [rows, N] arrays, kernel order
  array_dtype(name) -> str
  padded_k(k), group_size_for(k)
  te_decode_terms(load, k) -> [float32 PrimExpr]   load(name, row) at this column
  te_group_coefs(load, g) -> ([coef per term], offset)
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from qtvm.formats.base import QuantFormat, QuantizedTensor

# Block names are part of the contract between compute and schedule rules.
BLOCK_XSUM, BLOCK_ACC, BLOCK_OUT = "xsum", "acc", "y"


def partial_block(term: int) -> str:
    return f"partial_{term}"
KERNEL_ATTR = "qtvm.kernel"
FORMAT_ATTR = "qtvm.format"


def block_columns(a: np.ndarray, nb: int) -> np.ndarray:
    """[rows, N] -> [ceil(N / nb), rows, nb], zero-padded columns."""
    rows, n = a.shape
    nblk = -(-n // nb)
    padded = np.zeros((rows, nblk * nb), a.dtype)
    padded[:, :n] = a
    return np.ascontiguousarray(padded.reshape(rows, nblk, nb).transpose(1, 0, 2))


def pad_columns(qt: QuantizedTensor, multiple: int) -> QuantizedTensor:
    """``qt`` with zero columns appended up to a multiple of ``multiple``: every stored
    array all zeros there (codes, scales, offsets), which each format decodes to w = 0.
    A GPU kernel then walks whole column tiles with no guard; the caller slices y."""
    n = -(-qt.n // multiple) * multiple
    arrays = {name: np.pad(a, ((0, 0), (0, n - qt.n))) for name, a in qt.arrays.items()}
    return QuantizedTensor(qt.fmt, qt.k, n, arrays)


def blocked_arrays(qt: QuantizedTensor, nb: int) -> list[np.ndarray]:
    """The kernel's weight arguments, in order."""
    return [block_columns(qt.arrays[name], nb) for name in qt.fmt.array_rows(qt.k)]


def padded_reader(x: te.Tensor, k: int, kp: int):
    """x[i, kk] for kk < K_pad: rows past K are padding (zero weights, and x has none)."""
    if kp == k:
        return lambda i, kk: x[i, kk]
    return lambda i, kk: tirx.if_then_else(kk < k, x[i, tirx.min(kk, k - 1)], tirx.const(0.0, "float32"))


def weight_inputs(fmt: QuantFormat, k: int, n: int, nb: int, expert=None, experts: int = 0):
    """(stored placeholders by name, at_column(j) -> load(name, row)) for column-blocked weights.
    ``expert`` (a scalar var): the arrays of ``experts`` weights stacked (``expert_arrays``),
    expert ``expert``'s read."""
    nblk = -(-n // nb)
    lead = () if expert is None else (experts,)
    stored = {name: te.placeholder((*lead, nblk, rows, nb), fmt.array_dtype(name), name=name)
              for name, rows in fmt.array_rows(k).items()}
    pick = () if expert is None else (expert,)

    def at_column(j):
        return lambda name, row: stored[name][(*pick, j // nb, row, j % nb)]

    return stored, at_column


def decode_term_count(fmt: QuantFormat, at_column) -> int:
    zero = tirx.const(0, "int32")
    return len(fmt.te_decode_terms(at_column(zero), zero))


def _chunked_inputs(fmt: QuantFormat, k: int, n: int, nb: int, chunk: int | None):
    """What both chunked GEMV computes start from: the symbolic row count, K split in chunks
    that divide the group, x and the blocked weight arrays."""
    m = te.var("m", "int64")
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    ch = gs if chunk is None else int(chunk)
    if ch < 1 or gs % ch:
        raise ValueError(f"chunk {ch} does not divide the group size {gs}")
    x = te.placeholder((m, k), "float32", name="x")
    stored, at_column = weight_inputs(fmt, k, n, nb)
    return m, kp, gs, ch, (kp // ch, -(-n // nb), gs // ch), x, stored, at_column


def qmatmul_func(fmt: QuantFormat, k: int, n: int, nb: int, chunk: int | None = None) -> tvm.tirx.PrimFunc:
    """PrimFunc(x[m, k], *blocked weight arrays, y[m, n]) with its format attached.

    ``chunk`` (a divisor of the group size; default the group): K values per partial.
    The group coefficients distribute over a group's chunks (s * sum_c P_c = sum_c s * P_c),
    so with chunks smaller than the group a GPU lane reduces its own chunk and applies the
    group's coefficients itself, and lanes split K without a reduction per group.
    """
    m, kp, gs, ch, dims, x, stored, at_column = _chunked_inputs(fmt, k, n, nb, chunk)
    y, terms = _grouped_stages(fmt, k, n, nb, m, kp, ch, dims, x, lambda i, j: at_column(j))
    func = te.create_prim_func([x, *stored.values(), y])
    desc = dict(fmt.describe(), k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=terms)
    if chunk is not None:
        desc["chunk"] = ch
    return func.with_attrs({KERNEL_ATTR: "qmatmul", FORMAT_ATTR: desc})


def qmatmul_experts_func(fmt: QuantFormat, k: int, n: int, nb: int, experts: int,
                         chunk: int | None = None) -> tvm.tirx.PrimFunc:
    """PrimFunc(x[m, k], ids[m], *blocked arrays of every expert, y[m, n]): row i multiplied
    by expert ids[i]'s weight (a mixture of experts' routed matmul, ``take(W[E], ids) @ x``
    as the exporters write it). Each stored array gains a leading expert axis
    ([E, ceil(N / nb), rows, nb], ``expert_arrays``); the stages and block names are
    ``qmatmul_func``'s, so its schedules apply (x86: ``schedule_qmatmul_experts_x86``). An id
    is read modulo E (ONNX Gather's negative ids; a wrong id reads a wrong expert, never out of
    bounds). ``chunk``: as ``qmatmul_func``'s (GPU lanes)."""
    m, kp, gs, ch, dims, x, _, _ = _chunked_inputs(fmt, k, n, nb, chunk)
    ids = te.placeholder((m,), "int64", name="ids")
    stored = {name: te.placeholder((experts, dims[1], rows, nb), fmt.array_dtype(name), name=name)
              for name, rows in fmt.array_rows(k).items()}

    def at_row_column(i, j):
        e = tirx.floormod(ids[i], tirx.const(experts, "int64"))
        return lambda name, row: stored[name][e, j // nb, row, j % nb]

    y, terms = _grouped_stages(fmt, k, n, nb, m, kp, ch, dims, x, at_row_column)
    func = te.create_prim_func([x, ids, *stored.values(), y])
    desc = dict(fmt.describe(), k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=terms, experts=experts)
    if chunk is not None:
        desc["chunk"] = ch
    return func.with_attrs({KERNEL_ATTR: "qmatmul_experts", FORMAT_ATTR: desc})


def expert_arrays(tensors: list[QuantizedTensor], nb: int, int8: bool = False) -> list[np.ndarray]:
    """``qmatmul_experts_func``'s weight arguments: each expert's ``blocked_arrays``, stacked
    (``int8``: ``qmatmul_a8_expert_func``'s, each expert's ``a8_arrays``)."""
    per_expert = [(a8_arrays if int8 else blocked_arrays)(qt, nb) for qt in tensors]
    return [np.stack(parts) for parts in zip(*per_expert)]


def _grouped_stages(fmt: QuantFormat, k: int, n: int, nb: int, m, kp: int, ch: int, dims, x, at_row_column):
    """The grouped formula's stages (partials per decode term, x sums, the group reduction,
    y); ``at_row_column(i, j)`` -> load(name, row) of the weights row i multiplies at column j.
    Returns (y, number of decode terms)."""
    nchunks, nblk, per_group = dims
    xk = padded_reader(x, k, kp)
    num_terms = decode_term_count(fmt, lambda j: at_row_column(tirx.const(0, "int32"), j))

    def partial(t):
        r = te.reduce_axis((0, ch), name="kk")
        return te.compute(
            (m, nchunks, nblk * nb),
            lambda i, g, j: te.sum(xk(i, g * ch + r) * fmt.te_decode_terms(at_row_column(i, j), g * ch + r)[t],
                                   axis=r),
            name=partial_block(t))

    partials = [partial(t) for t in range(num_terms)]
    r2 = te.reduce_axis((0, ch), name="kx")
    xsum = te.compute((m, nchunks), lambda i, g: te.sum(xk(i, g * ch + r2), axis=r2), name=BLOCK_XSUM)

    rg = te.reduce_axis((0, nchunks), name="g")

    def group_term(i, j):
        coefs, offset = fmt.te_group_coefs(at_row_column(i, j), rg if per_group == 1 else rg // per_group)
        total = offset * xsum[i, rg]
        for coef, part in zip(coefs, partials):
            total = total + coef * part[i, rg, j]
        return total

    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(group_term(i, j), axis=rg), name=BLOCK_ACC)
    return te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT), num_terms


# -- fp16 activations (a user option: it rounds activations, GPU targets) ----
BLOCK_XH, BLOCK_DECODE = "x_f16", "w_decode"


def f16_unpack_kind(fmt: QuantFormat) -> str | None:
    """The fp16 unpack (``qtvm.intrin.cuda.RUNS``) of a format's single decode term, or None:
    uniform int2/3/4/8 (plain or packed zeros) decode to their integer code, E0M4 to
    1 + code / 16; both are exact in fp16."""
    desc = fmt.describe()
    if desc.get("family") == "e0m4" and getattr(fmt, "decode", "fp32") in ("fp32", "fp16"):
        return "e0m4"
    if desc.get("family") == "uniform" and int(desc.get("bits", 0)) in (2, 3, 4, 8):
        return f"u{int(desc['bits'])}"
    return None


def qmatmul_f16_func(fmt: QuantFormat, k: int, n: int, nb: int, chunk: int | None = None,
                     accumulate: str = "float16") -> tvm.tirx.PrimFunc:
    """``qmatmul_func``'s arguments and result with fp16 activations (a numerics option):

        x_f16[m, kk]   = fp16(x)                             the activations, rounded
        w_decode[j, kk] = fp16 decode of the code              exact (codes, 1 + c/16)
        P[m, c, j]     = sum_{kk in chunk c} x_f16 * w_decode  fp16 products and sums
        y[m, j]        = sum_c coef * fp32(P) + offset * sum_{kk in c} fp32(x_f16)

    so within a chunk (16 to 64 values) the dot runs in half precision (two weights per
    instruction on a GPU), across chunks and groups in fp32. ``accumulate="float32"``
    sums P in fp32 instead, of exact products (fp16 x fp16 fits fp32's mantissa): then the
    activation rounding is the only error. ``w_decode`` is a stage of its own so a schedule
    can decode a whole packed run with one TensorIntrin.
    """
    from qtvm.intrin.runs import RUNS, unpack_value

    kind = f16_unpack_kind(fmt)
    if kind is None:
        raise ValueError(f"{fmt.name} has no fp16 decode")
    words, values, _ = RUNS[kind]
    m, kp, gs, ch, (nchunks, nblk, per_group), x, stored, at_column = _chunked_inputs(fmt, k, n, nb, chunk)
    qweight = stored["qweight"]
    xk = padded_reader(x, k, kp)
    xh = te.compute((m, kp), lambda i, kk: xk(i, kk).astype("float16"), name=BLOCK_XH)
    dec = te.compute((nblk * nb, kp), lambda j, kk: unpack_value(
        kind, lambda r: qweight[j // nb, (kk // values) * words + r, j % nb], kk % values), name=BLOCK_DECODE)
    if accumulate not in ("float16", "float32"):
        raise ValueError(f"accumulate must be float16 or float32, got {accumulate}")
    r = te.reduce_axis((0, ch), name="kk")
    partial = te.compute((m, nchunks, nblk * nb), lambda i, c, j: te.sum(
        xh[i, c * ch + r].astype(accumulate) * dec[j, c * ch + r].astype(accumulate), axis=r), name=partial_block(0))
    r2 = te.reduce_axis((0, ch), name="kx")
    xsum = te.compute((m, nchunks), lambda i, c: te.sum(xh[i, c * ch + r2].astype("float32"), axis=r2),
                      name=BLOCK_XSUM)
    rg = te.reduce_axis((0, nchunks), name="g")

    def group_term(i, j):
        coefs, offset = fmt.te_group_coefs(at_column(j), rg if per_group == 1 else rg // per_group)
        return coefs[0] * partial[i, rg, j].astype("float32") + offset * xsum[i, rg]

    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(group_term(i, j), axis=rg), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    func = te.create_prim_func([x, *stored.values(), y])
    desc = dict(fmt.describe(), k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=1, chunk=ch,
                activations="fp16", unpack=kind, accumulate=accumulate)
    return func.with_attrs({KERNEL_ATTR: "qmatmul_f16", FORMAT_ATTR: desc})


# -- int8 activations (a user option: it rounds activations) -----------------
ACT_BLOCK = 32  # activations share one fp32 scale per 32 values (as llama.cpp's Q8)
BLOCK_DOT, BLOCK_GPART = "dot", "gpart"


def supports_int8_activations(fmt: QuantFormat, k: int) -> bool:
    """The byte-plane dot needs 2/3/4-bit codes the weight is affine in, 32-aligned groups."""
    from qtvm.intrin.x86 import BITS

    zero = tirx.const(0, "int32")
    affine = fmt.te_code_affine(lambda name, row: tirx.const(0, fmt.array_dtype(name)), zero) is not None
    return (affine and fmt.describe().get("bits") in BITS
            and fmt.group_size_for(k) % ACT_BLOCK == 0 and fmt.padded_k(k) % ACT_BLOCK == 0)


def a8_arrays(qt: QuantizedTensor, nb: int) -> list[np.ndarray]:
    """The int8-activation kernel's weight arguments: ``blocked_arrays`` with the codes
    in byte-plane order (``qtvm.intrin.x86``), a compile-time relayout: QIGen's 3-bit runs
    re-packed, 2/4-bit words' fields shuffled in place."""
    from qtvm.intrin.x86 import byte_plane_words, pack_byte_planes

    arrays = blocked_arrays(qt, nb)
    index, bits = list(qt.fmt.array_rows(qt.k)).index("qweight"), int(qt.fmt.describe()["bits"])
    if bits == 3:
        codes = qt.fmt.unpack(qt.arrays["qweight"], qt.fmt.padded_k(qt.k))
        arrays[index] = block_columns(pack_byte_planes(codes, 3), nb)
    else:
        arrays[index] = byte_plane_words(arrays[index], bits)
    return arrays


def quantize_activations_func(fmt: QuantFormat, k: int, row_tile: int = 1) -> tvm.tirx.PrimFunc:
    """x[m, k] -> (xq[mp, K_pad] int8, xd[mp, K_pad/32] scales, xs[mp, G] group sums),
    mp = m rounded up to ``row_tile`` (the padding rows are zero: the prefill kernel works in
    row tiles). The prefill kernel's first step; the GEMV computes the same stages itself."""
    m = te.var("m", "int64")
    x = te.placeholder((m, k), "float32", name="x")
    xq, xd, xs = _quantize_stages(fmt, k, x, m, row_tile)
    func = te.create_prim_func([x, xq, xd, xs])
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    return func.with_attrs({KERNEL_ATTR: "quantize_activations",
                            FORMAT_ATTR: dict(fmt.describe(), k=k, padded_k=kp, group=gs, row_tile=row_tile)})


def _quantize_stages(fmt: QuantFormat, k: int, x: te.Tensor, m, row_tile: int = 1):
    """x's int8 rounding per 32 values: (xq, xd, xs) over m rows rounded up to ``row_tile``.

    xs sums the *rounded* activations (sum_b xd_b * sum xq), so the kernel
    computes exactly x_hat @ W_hat: the zero-point term then cancels the
    rounding error of x * code instead of amplifying it (as llama.cpp's q8_1).
    """
    mp = m if row_tile == 1 else ((m - 1) // row_tile + 1) * row_tile
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    xk_rows = padded_reader(x, k, kp)
    xk = xk_rows if row_tile == 1 else (lambda i, kk: tirx.if_then_else(
        i < m, xk_rows(tirx.min(i, m - 1), kk), tirx.const(0.0, "float32")))

    r = te.reduce_axis((0, ACT_BLOCK), name="r")
    amax = te.compute((mp, kp // ACT_BLOCK), lambda i, b: te.max(tirx.abs(xk(i, b * ACT_BLOCK + r)), axis=r),
                      name="amax")
    xd = te.compute((mp, kp // ACT_BLOCK), lambda i, b: amax[i, b] / 127.0, name="xd")

    inv = te.compute((mp, kp // ACT_BLOCK), lambda i, b: tirx.if_then_else(
        amax[i, b] > 0, 127.0 / tirx.max(amax[i, b], tirx.const(1e-30, "float32")), tirx.const(0.0, "float32")),
        name="inv")

    xq = te.compute((mp, kp), lambda i, pos: tirx.max(tirx.min(
        tirx.round(xk(i, pos) * inv[i, pos // ACT_BLOCK]), 127.0), -127.0).astype("int8"), name="xq")
    r2 = te.reduce_axis((0, ACT_BLOCK), name="r2")
    bsum = te.compute((mp, kp // ACT_BLOCK), lambda i, b: te.sum(xq[i, b * ACT_BLOCK + r2].astype("int32"), axis=r2),
                      name="bsum")
    per_group = gs // ACT_BLOCK
    r3 = te.reduce_axis((0, per_group), name="r3")
    xs = te.compute((mp, kp // gs), lambda i, g: te.sum(
        xd[i, g * per_group + r3] * bsum[i, g * per_group + r3].astype("float32"), axis=r3), name="xs")
    return xq, xd, xs


def _a8_inputs(fmt: QuantFormat, k: int, n: int, nb: int, rows):
    """The prefill kernel's inputs for ``rows`` activation rows (``quantize_activations_func``'s outputs)."""
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    xq = te.placeholder((rows, kp), "int8", name="xq")
    xd = te.placeholder((rows, kp // ACT_BLOCK), "float32", name="xd")
    xs = te.placeholder((rows, kp // gs), "float32", name="xs")
    stored, at_column = weight_inputs(fmt, k, n, nb)
    return xq, xd, xs, stored, at_column


def _a8_stages(fmt: QuantFormat, k: int, n: int, nb: int, xq, xd, xs, stored, at_column, row_shape, row_of):
    """dot -> gpart -> acc over output rows of shape ``row_shape``; ``row_of(*row)`` is the
    activation row. Returns acc[*row, j]."""
    from qtvm.intrin.x86 import block_code

    bits = int(fmt.describe()["bits"])
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    ngroups, nblk, nact = kp // gs, -(-n // nb), kp // ACT_BLOCK
    acts_per_group = gs // ACT_BLOCK
    nr = len(row_shape)

    # dot[*rows, b, j]; with a row tile (t, r) stored [t, b, r, j]: rows next to columns,
    # so the tile's accumulators are one [rows, lanes] region for the intrinsic.
    tiled = nr == 2
    def dot_index(rows, b, j):
        return (rows[0], b, rows[1], j) if tiled else (*rows, b, j)

    rj = te.reduce_axis((0, ACT_BLOCK), name="rj")

    def dot_value(*idx):
        rows, b, j = (idx[:1] + idx[2:3], idx[1], idx[3]) if tiled else (idx[:nr], idx[nr], idx[nr + 1])
        return te.sum(
            xq[row_of(*rows), b * ACT_BLOCK + rj].astype("int32")
            # qweight in byte-plane order (``a8_arrays``): ``bits`` words per 32 values
            * block_code(bits, lambda t: at_column(j)("qweight", b * bits + t), rj),
            axis=rj)

    dot = te.compute(dot_index(row_shape, nact, nblk * nb), dot_value, name=BLOCK_DOT)
    rb = te.reduce_axis((0, acts_per_group), name="rb")
    gpart = te.compute(
        (*row_shape, ngroups, nblk * nb),
        lambda *idx: te.sum(xd[row_of(*idx[:nr]), idx[nr] * acts_per_group + rb]
                            * dot[dot_index(idx[:nr], idx[nr] * acts_per_group + rb, idx[nr + 1])].astype("float32"),
                            axis=rb),
        name=BLOCK_GPART)
    rg = te.reduce_axis((0, ngroups), name="g")

    def group_term(*idx):
        coef, offset = fmt.te_code_affine(at_column(idx[nr]), rg)
        return coef * gpart[(*idx[:nr], rg, idx[nr])] + offset * xs[row_of(*idx[:nr]), rg]

    return te.compute((*row_shape, nblk * nb), lambda *idx: te.sum(group_term(*idx), axis=rg), name=BLOCK_ACC)


def _a8_func(fmt, k, n, nb, args, y, kernel: str, **extra) -> tvm.tirx.PrimFunc:
    func = te.create_prim_func([*args, y])
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    attrs = dict(fmt.describe(), k=k, n=n, col_block=nb, padded_k=kp, group=gs, activations="int8", **extra)
    return func.with_attrs({KERNEL_ATTR: kernel, FORMAT_ATTR: attrs})


def qmatmul_a8_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(x, *a8_arrays, y): y = x @ W with int8-rounded x (the GEMV), the rounding
    (``_quantize_stages``) in the same function, not a call of its own: one call and no
    scratch tensors a GEMV (speed level with the separate call within the Intel Xeon VM's noise;
    run in each thread instead, it measured no faster either).

    dot[m, b, n] = sum over 32 values of xq * code (int32, exact)
    y[m, n] = sum_g scale * sum_{b in g} xd[m, b] * dot[m, b, n] + offset * xs[m, g]
    """
    m = te.var("m", "int64")
    x = te.placeholder((m, k), "float32", name="x")
    xq, xd, xs = _quantize_stages(fmt, k, x, m)
    stored, at_column = weight_inputs(fmt, k, n, nb)
    acc = _a8_stages(fmt, k, n, nb, xq, xd, xs, stored, at_column, (m,), lambda i: i)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    return _a8_func(fmt, k, n, nb, [x, *stored.values()], y, "qmatmul_a8")


def qmatmul_a8_expert_func(fmt: QuantFormat, k: int, n: int, nb: int, experts: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(x, expert, *a8_arrays of ``experts`` weights stacked, y): ``qmatmul_a8_func``
    by expert ``expert``'s weight, a scalar the x86 rule replaces by each row's routed expert
    (``schedules.x86.route_rows``): the int8 dot's TensorIntrin matches only a block whose
    weight index reads no buffer, so the id is bound outside the scheduled blocks."""
    m = te.var("m", "int64")
    x = te.placeholder((m, k), "float32", name="x")
    ids = te.placeholder((m,), "int64", name="ids")  # read once the rule binds ``expert`` to ids[i] mod E
    expert = te.var("expert", "int64")
    xq, xd, xs = _quantize_stages(fmt, k, x, m)
    stored, at_column = weight_inputs(fmt, k, n, nb, expert, experts)
    acc = _a8_stages(fmt, k, n, nb, xq, xd, xs, stored, at_column, (m,), lambda i: i)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    return _a8_func(fmt, k, n, nb, [x, ids, expert, *stored.values()], y, "qmatmul_a8_experts", experts=experts)


def qmatmul_a8_gemm_func(fmt: QuantFormat, k: int, n: int, nb: int, row_tile: int) -> tvm.tirx.PrimFunc:
    """The prefill form: rows in tiles of ``row_tile`` so each unpacked weight vector is
    dotted with ``row_tile`` rows. Takes the activations of
    ``quantize_activations_func(..., row_tile)`` (m rounded up to row_tile, zero padded)."""
    m = te.var("m", "int64")
    tiles = (m - 1) // row_tile + 1  # (m + R - 1) // R, in the form TVM proves covers y's rows
    xq, xd, xs, stored, at_column = _a8_inputs(fmt, k, n, nb, tiles * row_tile)
    rows = tirx.const(row_tile, "int64")  # int64 like M's loops, as the intrinsic's row loop
    acc = _a8_stages(fmt, k, n, nb, xq, xd, xs, stored, at_column, (tiles, rows), lambda t, r: t * row_tile + r)
    y = te.compute((m, n), lambda i, j: acc[i // row_tile, i % row_tile, j], name=BLOCK_OUT)
    return _a8_func(fmt, k, n, nb, [xq, xd, xs, *stored.values()], y, "qmatmul_a8_gemm", row_tile=row_tile)
