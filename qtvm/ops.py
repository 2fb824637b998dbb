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


def blocked_arrays(qt: QuantizedTensor, nb: int) -> list[np.ndarray]:
    """The kernel's weight arguments, in order."""
    return [block_columns(qt.arrays[name], nb) for name in qt.fmt.array_rows(qt.k)]


def padded_reader(x: te.Tensor, k: int, kp: int):
    """x[i, kk] for kk < K_pad: rows past K are padding (zero weights, and x has none)."""
    if kp == k:
        return lambda i, kk: x[i, kk]
    return lambda i, kk: tirx.if_then_else(kk < k, x[i, tirx.min(kk, k - 1)], tirx.const(0.0, "float32"))


def weight_inputs(fmt: QuantFormat, k: int, n: int, nb: int):
    """(stored placeholders by name, at_column(j) -> load(name, row)) for column-blocked weights."""
    nblk = -(-n // nb)
    stored = {name: te.placeholder((nblk, rows, nb), fmt.array_dtype(name), name=name)
              for name, rows in fmt.array_rows(k).items()}

    def at_column(j):
        return lambda name, row: stored[name][j // nb, row, j % nb]

    return stored, at_column


def decode_term_count(fmt: QuantFormat, at_column) -> int:
    zero = tirx.const(0, "int32")
    return len(fmt.te_decode_terms(at_column(zero), zero))


def qmatmul_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(x[m, k], *blocked weight arrays, y[m, n]) with its format attached."""
    m = te.var("m", "int64")
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    ngroups, nblk = kp // gs, -(-n // nb)
    x = te.placeholder((m, k), "float32", name="x")
    stored, at_column = weight_inputs(fmt, k, n, nb)
    xk = padded_reader(x, k, kp)

    num_terms = decode_term_count(fmt, at_column)
    def partial(t):
        r = te.reduce_axis((0, gs), name="kk")
        return te.compute(
            (m, ngroups, nblk * nb),
            lambda i, g, j: te.sum(xk(i, g * gs + r) * fmt.te_decode_terms(at_column(j), g * gs + r)[t], axis=r),
            name=partial_block(t))

    partials = [partial(t) for t in range(num_terms)]
    r2 = te.reduce_axis((0, gs), name="kx")
    xsum = te.compute((m, ngroups), lambda i, g: te.sum(xk(i, g * gs + r2), axis=r2), name=BLOCK_XSUM)

    rg = te.reduce_axis((0, ngroups), name="g")

    def group_term(i, j):
        coefs, offset = fmt.te_group_coefs(at_column(j), rg)
        total = offset * xsum[i, rg]
        for coef, part in zip(coefs, partials):
            total = total + coef * part[i, rg, j]
        return total

    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(group_term(i, j), axis=rg), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    func = te.create_prim_func([x, *stored.values(), y])
    desc = dict(fmt.describe(), k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=num_terms)
    return func.with_attrs({KERNEL_ATTR: "qmatmul", FORMAT_ATTR: desc})


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
    in byte-plane order (a compile-time relayout for 3-bit; 2/4-bit are already in it)."""
    from qtvm.intrin.x86 import pack_byte_planes

    arrays = blocked_arrays(qt, nb)
    if int(qt.fmt.describe()["bits"]) == 3:
        codes = qt.fmt.unpack(qt.arrays["qweight"], qt.fmt.padded_k(qt.k))
        arrays[list(qt.fmt.array_rows(qt.k)).index("qweight")] = block_columns(pack_byte_planes(codes, 3), nb)
    return arrays


def quantize_activations_func(fmt: QuantFormat, k: int) -> tvm.tirx.PrimFunc:
    """x[m, k] -> (xq[m, K_pad] int8 in byte-plane order, xd[m, K_pad/32] scales, xs[m, G] group sums).

    xs sums the *rounded* activations (sum_b xd_b * sum xq), so the kernel
    computes exactly x_hat @ W_hat: the zero-point term then cancels the
    rounding error of x * code instead of amplifying it (as llama.cpp's q8_1).
    """
    from qtvm.intrin.x86 import act_value

    bits = int(fmt.describe()["bits"])
    m = te.var("m", "int64")
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    x = te.placeholder((m, k), "float32", name="x")
    xk = padded_reader(x, k, kp)

    r = te.reduce_axis((0, ACT_BLOCK), name="r")
    amax = te.compute((m, kp // ACT_BLOCK), lambda i, b: te.max(tirx.abs(xk(i, b * ACT_BLOCK + r)), axis=r), name="amax")
    xd = te.compute((m, kp // ACT_BLOCK), lambda i, b: amax[i, b] / 127.0, name="xd")

    def quant(i, pos):
        q = pos % ACT_BLOCK
        src = pos - q + act_value(bits, q)  # byte-plane position -> value index
        a = amax[i, src // ACT_BLOCK]
        inv = tirx.if_then_else(a > 0, 127.0 / tirx.max(a, tirx.const(1e-30, "float32")), tirx.const(0.0, "float32"))
        return tirx.max(tirx.min(tirx.round(xk(i, src) * inv), 127.0), -127.0).astype("int8")

    xq = te.compute((m, kp), quant, name="xq")
    r2 = te.reduce_axis((0, ACT_BLOCK), name="r2")
    bsum = te.compute((m, kp // ACT_BLOCK), lambda i, b: te.sum(xq[i, b * ACT_BLOCK + r2].astype("int32"), axis=r2),
                      name="bsum")
    per_group = gs // ACT_BLOCK
    r3 = te.reduce_axis((0, per_group), name="r3")
    xs = te.compute((m, kp // gs), lambda i, g: te.sum(
        xd[i, g * per_group + r3] * bsum[i, g * per_group + r3].astype("float32"), axis=r3), name="xs")
    func = te.create_prim_func([x, xq, xd, xs])
    return func.with_attrs({KERNEL_ATTR: "quantize_activations",
                            FORMAT_ATTR: dict(fmt.describe(), k=k, padded_k=kp, group=gs)})


def qmatmul_a8_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(xq, xd, xs, *a8_arrays, y): y = x @ W with int8-rounded x.

    dot[m, b, n] = sum over 32 values of xq * code (int32, exact)
    y[m, n] = sum_g scale * sum_{b in g} xd[m, b] * dot[m, b, n] + offset * xs[m, g]
    """
    from qtvm.intrin.x86 import act_position, block_code

    desc = fmt.describe()
    bits = int(desc["bits"])
    m = te.var("m", "int64")
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    ngroups, nblk, nact = kp // gs, -(-n // nb), kp // ACT_BLOCK
    acts_per_group = gs // ACT_BLOCK
    xq = te.placeholder((m, kp), "int8", name="xq")
    xd = te.placeholder((m, nact), "float32", name="xd")
    xs = te.placeholder((m, ngroups), "float32", name="xs")
    stored, at_column = weight_inputs(fmt, k, n, nb)
    qw = stored["qweight"]  # byte-plane order (``a8_arrays``): ``bits`` words per 32 values

    rj = te.reduce_axis((0, ACT_BLOCK), name="rj")
    dot = te.compute(
        (m, nact, nblk * nb),
        lambda i, b, j: te.sum(
            xq[i, b * ACT_BLOCK + act_position(bits, rj)].astype("int32")
            * block_code(bits, lambda t: qw[j // nb, b * bits + t, j % nb], rj),
            axis=rj),
        name=BLOCK_DOT)
    rb = te.reduce_axis((0, acts_per_group), name="rb")
    gpart = te.compute(
        (m, ngroups, nblk * nb),
        lambda i, g, j: te.sum(xd[i, g * acts_per_group + rb] * dot[i, g * acts_per_group + rb, j].astype("float32"),
                               axis=rb),
        name=BLOCK_GPART)
    rg = te.reduce_axis((0, ngroups), name="g")

    def group_term(i, j):
        coef, offset = fmt.te_code_affine(at_column(j), rg)
        return coef * gpart[i, rg, j] + offset * xs[i, rg]

    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(group_term(i, j), axis=rg), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    func = te.create_prim_func([xq, xd, xs, *stored.values(), y])
    attrs = dict(desc, k=k, n=n, col_block=nb, padded_k=kp, group=gs, activations="int8")
    return func.with_attrs({KERNEL_ATTR: "qmatmul_a8", FORMAT_ATTR: attrs})
