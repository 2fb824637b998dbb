"""The generic-op rule (schedules/x86_generic.py): same numbers as TVM's default loops and
onnxruntime at every (batch, seq) one module serves, and the functions really scheduled."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from tvm import relax, te, tirx

from qtvm.formats import get_format
from qtvm.pipeline import build_module
from qtvm.reference import dequantized_model
from qtvm.target import parse_target
from schedules.x86_generic import is_scheduled, schedule_generic_func, schedule_generic_ops

# seq = 1 (decode), odd and ragged lengths (tails of the 4-row and vector tiles), M <= 2
# (GEMV branch) and M > 2 (GEMM branch) of the packed kernels.
SHAPES = [(1, 1), (2, 1), (1, 16), (1, 33), (3, 17), (2, 64)]


def _compiled(func, target=None):
    """``func`` built alone (as ``main``) for ``target``, plain LLVM by default: its runtime module."""
    target = target or tvm.target.Target({"kind": "llvm"})
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target).mod


@pytest.fixture(scope="module")
def target():
    return parse_target("host")


@pytest.fixture(scope="module")
def modules(tiny_llama_path, target):
    """act -> (VM with TVM's default loops, VM with the rule, scheduled IRModule)."""
    out = {}
    for act in ("fp32", "int8"):
        mod, *_ = build_module(tiny_llama_path, target, "int4-g128", act)
        scheduled = schedule_generic_ops(mod, target)
        out[act] = (relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu()),
                    relax.VirtualMachine(tvm.compile(scheduled, target=target), tvm.cpu()),
                    scheduled)
    return out


@pytest.fixture(scope="module")
def ort_dequantized(tiny_llama_path):
    model = dequantized_model(onnx.load(str(tiny_llama_path)), get_format("int4-g128"))
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run(vm, ids):
    return vm["main"](tvm.runtime.tensor(ids)).numpy().astype(np.float64)


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_fp32_matches_default_loops_and_onnxruntime(modules, ort_dequantized, batch, seq):
    default, scheduled, _ = modules["fp32"]
    ids = np.random.default_rng(batch * 100 + seq).integers(0, 512, (batch, seq)).astype(np.int64)
    got = _run(scheduled, ids)
    assert got.shape == (batch, seq, 512)
    assert _rel(got, _run(default, ids)) < 2e-5
    assert _rel(got, ort_dequantized.run(None, {"input_ids": ids})[0].astype(np.float64)) < 2e-5


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_int8_activations_match_onnxruntime(modules, ort_dequantized, batch, seq):
    """int8 rounding of each matmul input makes ~1e-2 the expected error (as unscheduled);
    a last-bit difference upstream may flip a rounding, so the two builds agree to that."""
    default, scheduled, _ = modules["int8"]
    ids = np.random.default_rng(batch * 100 + seq + 7).integers(0, 512, (batch, seq)).astype(np.int64)
    got = _run(scheduled, ids)
    assert _rel(got, ort_dequantized.run(None, {"input_ids": ids})[0].astype(np.float64)) < 0.05
    assert _rel(got, _run(default, ids)) < 0.05


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}


def test_rule_schedules_the_generic_ops(modules):
    funcs = _prim_funcs(modules["fp32"][2])
    generic = {n: f for n, f in funcs.items()
               if "qtvm.kernel" not in (f.attrs or {}) and not relax.analysis.has_reshape_pattern(f)}
    scheduled = [n for n, f in generic.items() if is_scheduled(f)]
    # Everything but cumsum's hand-written scan (positions) gets a schedule.
    assert set(generic) - set(scheduled) <= {n for n in generic if n.startswith("cumsum")}
    assert len(scheduled) >= 10
    scripts = {n: generic[n].script() for n in scheduled}
    assert sum("T.vectorized" in s for s in scripts.values()) >= 8
    fused = [n for n in scheduled if n.startswith("fused_")]
    assert len(fused) >= 5  # FuseOps ran: the default pipeline leaves ~165 single-op calls

    # Attention matmuls: padded operands, a register ("local") tile, vector FMAs.
    matmuls = [s for s in scripts.values() if '_pad"' in s or "_pad =" in s]
    assert len(matmuls) == 2
    assert all('scope="local"' in s and "T.vectorized" in s for s in matmuls)
    # Softmax / RMSNorm: exp rewritten (no scalar libm call left) and rows vectorized.
    assert not any("T.exp(" in s or "T.sigmoid(" in s for s in scripts.values())
    # Attention on every thread: both matmuls and the softmax parallel over the heads; the
    # elementwise functions parallel from 2^18 elements on (prefill), serial below (decode:
    # the else branch); the rest (rows over symbolic batch x seq only) serial.
    parallel = {n for n, s in scripts.items() if "T.parallel" in s}
    assert all("T.parallel" in s for s in matmuls)
    attention = {n for n in parallel if "softmax" in n or scripts[n] in matmuls}
    assert any("softmax" in n for n in attention) and len(attention) == 3
    for name in parallel - attention:
        large, small = scripts[name].split("\n    else:\n")
        assert ">= T.int64(262144):" in large and "T.parallel" in large and "T.parallel" not in small
    # The packed kernels were left exactly as quantize_weights scheduled them.
    kernels = [f for f in funcs.values() if "qtvm.kernel" in (f.attrs or {})]
    assert kernels and all(f.attrs.get("op_pattern") == 8 for f in kernels)


def test_not_llvm_is_untouched(tiny_llama_path, target):
    mod, *_ = build_module(tiny_llama_path, target, "none")
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert schedule_generic_ops(mod, cuda).same_as(mod)  # GPU targets: schedules/gpu_generic.py


def test_vectorizable_exp_is_accurate(target):
    """exp / sigmoid through the rule: <= 2 ulp relative error where the result is a
    normal float above 2^-124, exact overflow / underflow / NaN behaviour."""
    n = te.var("n", "int64")
    x = te.placeholder((n,), "float32", name="x")
    e = te.compute((n,), lambda i: te.exp(x[i]), name="e")
    s = te.compute((n,), lambda i: te.sigmoid(x[i]), name="s")
    func = schedule_generic_func(te.create_prim_func([x, e, s]), lanes=8)
    assert func is not None and "T.exp(" not in func.script()
    lib = _compiled(func, target)
    special = [np.inf, -np.inf, np.nan, 88.8, -104.0, 0.0]
    xs = np.concatenate([np.linspace(-87, 88.7, 100_003), special]).astype(np.float32)
    args = [tvm.runtime.tensor(xs), tvm.runtime.tensor(np.zeros_like(xs)), tvm.runtime.tensor(np.zeros_like(xs))]
    lib["main"](*args)
    got_e, got_s = args[1].numpy().astype(np.float64), args[2].numpy().astype(np.float64)
    x64 = xs.astype(np.float64)
    body = slice(0, -len(special))
    want_e = np.exp(x64[body])
    normal = want_e > 2.0 ** -124  # flushed to zero below about 2^-125
    assert (np.abs(got_e[body] - want_e)[normal] / want_e[normal]).max() < 2 * 2.0 ** -24
    want_s = 1 / (1 + np.exp(-x64[body]))
    assert (np.abs(got_s[body] - want_s) / want_s).max() < 4 * 2.0 ** -24
    np.testing.assert_array_equal(got_e[-6:], [np.inf, 0.0, np.nan, np.inf, 0.0, 1.0])
    np.testing.assert_array_equal(got_s[-6:], [1.0, 0.0, np.nan, 1.0, 0.0, 0.5])


def test_compiled_artefact_keeps_metadata_and_runs(tiny_llama_int4):
    """FuseTIR drops uncalled functions; the artefact's metadata function must survive."""
    from qtvm import runtime

    module = runtime.load(tiny_llama_int4[0])
    assert module.inputs == [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}]
    ids = np.zeros((1, 3), dtype=np.int64)
    assert module.run({"input_ids": ids})["logits"].shape == (1, 3, 512)


def test_nothing_is_inlined_into_guarded_loads():
    """A block that reads under if_then_else (concat, pad) gets no producer inlined: with its
    producers inlined, the 3-D RotaryEmbedding's concat miscompiled on znver4/znver5 targets;
    a plain elementwise consumer still inlines them."""
    a, b = te.placeholder((2, 3, 4), name="a"), te.placeholder((2, 3, 4), name="b")
    scaled = te.compute((2, 3, 4), lambda i, j, k: a[i, j, k] * 2.0, name="scaled")
    cat = te.compute((2, 3, 8), lambda i, j, k: tirx.if_then_else(k < 4, scaled[i, j, k], b[i, j, k - 4]), name="cat")
    guarded = schedule_generic_func(te.create_prim_func([a, b, cat]))
    assert is_scheduled(guarded) and 'T.sblock("scaled")' in guarded.script()
    add = te.compute((2, 3, 4), lambda i, j, k: scaled[i, j, k] + b[i, j, k], name="add")
    plain = schedule_generic_func(te.create_prim_func([a, b, add]))
    assert is_scheduled(plain) and 'T.sblock("scaled")' not in plain.script()


def test_a_bool_chosen_by_if_then_else_stays_scalar():
    """Funnel's pooled attention mask (rows 0 and 2i - 1 of a bool mask, concatenated; int64
    indices, as Relax legalizes them): vectorized, TVM's LLVM codegen joined the branches' bool
    vectors with a mistyped phi and LLVM's verifier refused the module. It stays scalar,
    builds, and computes numpy's rows."""
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    batch = tirx.Var("batch", "int64")
    mask = te.placeholder((batch, i64(5), i64(5)), "bool", name="mask")
    first = te.compute((batch, i64(1), i64(5)), lambda b, i, j: mask[b, i, j], name="first")
    pooled = te.compute((batch, i64(3), i64(5)), lambda b, i, j: tirx.if_then_else(
        i64(1) <= i * i64(2), mask[b, i * i64(2) - i64(1), j], first[b, i64(0), j]), name="pooled")
    scheduled = schedule_generic_func(te.create_prim_func([mask, pooled]))
    assert is_scheduled(scheduled)
    rng = np.random.default_rng(0)
    m = rng.random((2, 5, 5)) < 0.5
    out = tvm.runtime.tensor(np.zeros((2, 3, 5), bool))
    _compiled(scheduled)["main"](tvm.runtime.tensor(m), out)
    np.testing.assert_array_equal(out.numpy(), np.concatenate([m[:, :1], m[:, 1:4:2]], axis=1))


def test_a_bfloat16_max_with_a_constant_init_builds_and_is_right():
    """A bfloat16 max over rows (PhiMoE's bfloat16 router): its -inf init vectorized failed to
    build (TVM's bfloat16 storage legalization left the broadcast constant bfloat16 in a uint16
    store); such stores stay scalar, the rest of the nest is still scheduled."""
    import ml_dtypes

    x = te.placeholder((6, 2, 8), "bfloat16", name="x")
    r = te.reduce_axis((0, 2), name="r")
    top = te.compute((6, 8), lambda i, j: te.max(x[i, r, j], axis=r), name="top")
    scheduled = schedule_generic_func(te.create_prim_func([x, top]))
    assert is_scheduled(scheduled)
    v = np.random.default_rng(0).standard_normal((6, 2, 8)).astype(ml_dtypes.bfloat16)
    out = tvm.runtime.empty((6, 8), "bfloat16")
    _compiled(scheduled)["main"](tvm.runtime.tensor(v), out)
    np.testing.assert_array_equal(out.numpy().astype(np.float32), v.astype(np.float32).max(axis=1))


@pytest.mark.parametrize("lanes,cols,row_vectors", [(16, 64, 4), (16, 32, 2), (8, 64, 1), (8, 16, 2), (16, 48, 3),
                                                    (16, 80, 1), (16, 56, 1)])
def test_attention_tile_spans_a_short_constant_row(lanes, cols, row_vectors):
    """probs @ V: B's whole row (the head dim) in one register tile where it is at most 4
    vectors and 4 x them fit half the registers, so V streams in order; a symbolic width
    (q @ K^T's key count) keeps one vector. Same numbers as the default loops at ragged rows."""
    from schedules.x86_generic import _row_vectors

    n = tirx.Var("n", "int64")
    heads, rows = 3, tirx.Var("rows", "int64")
    p = te.placeholder((heads, rows, n), name="p")
    v = te.placeholder((heads, n, cols), name="v")
    r = te.reduce_axis((0, n), name="r")
    out = te.compute((heads, rows, cols), lambda h, i, j: te.sum(p[h, i, r] * v[h, r, j], axis=r), name="pv")
    func = te.create_prim_func([p, v, out])
    assert _row_vectors(tirx.IntImm("int64", cols), lanes) == row_vectors
    assert _row_vectors(n * 64, lanes) == 1
    scheduled = schedule_generic_func(func, lanes)
    assert is_scheduled(scheduled)
    built, default = _compiled(scheduled), _compiled(func)
    rng = np.random.default_rng(cols)
    for m, length in ((1, 5), (8, 37), (7, 128)):
        a = rng.standard_normal((heads, m, length)).astype(np.float32)
        b = rng.standard_normal((heads, length, cols)).astype(np.float32)
        got, want = (tvm.runtime.tensor(np.zeros((heads, m, cols), np.float32)) for _ in range(2))
        built["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), got)
        default["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), want)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.numpy(), a @ b, rtol=1e-4, atol=1e-4)


def test_softmax_over_whole_vectors_of_a_symbol_is_vectorized():
    """The KV step's softmax runs over kv_blocks x 64 keys: provably whole vectors, so its
    max and sum are rfactored over the lanes (they were scalar chains); a row of symbolic
    length that is not provably so stays scalar. Same numbers as the default loops."""
    blocks, n = tirx.Var("kv_blocks", "int64"), tirx.Var("n", "int64")
    for length, split in ((blocks * 64, True), (n, False)):
        x = te.placeholder((3, length), name="x")
        r = te.reduce_axis((0, length), name="r")
        top = te.compute((3,), lambda i: te.max(x[i, r], axis=r), name="top")
        e = te.compute((3, length), lambda i, j: te.exp(x[i, j] - top[i]), name="e")
        r2 = te.reduce_axis((0, length), name="r2")
        total = te.compute((3,), lambda i: te.sum(e[i, r2], axis=r2), name="total")
        y = te.compute((3, length), lambda i, j: e[i, j] / total[i], name="y")
        func = te.create_prim_func([x, y, blocks] if split else [x, y])  # kv_blocks: a parameter, as in the step
        scheduled = schedule_generic_func(func, 16)
        assert is_scheduled(scheduled) and ("top_rf" in scheduled.script()) == split
        assert ("total_rf" in scheduled.script()) == split
        built = _compiled(scheduled)
        rng = np.random.default_rng(3)
        for cols in (64, 192, 1920):
            a = (4 * rng.standard_normal((3, cols))).astype(np.float32)
            args = [tvm.runtime.tensor(a), tvm.runtime.tensor(np.zeros_like(a))]
            built["main"](*args, *([cols // 64] if split else []))
            want = np.exp(a - a.max(1, keepdims=True))
            np.testing.assert_allclose(args[1].numpy(), want / want.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_guarded_softmax_keeps_no_full_size_normalisation():
    """torch's guarded softmax, where(isnan(e / sum), 0, e / sum): the isnan test is inlined
    into the select first, so the division has one consumer and is inlined too; its full-size
    intermediate (each row written once, and in prefill written back to DRAM) is gone. Against
    TVM's default loops (the rule's exp and lane-split sums differ in the last bits), a fully
    masked row (all -inf: NaN before the guard) included."""
    blocks = tirx.Var("kv_blocks", "int64")
    x = te.placeholder((2, 3, blocks * 64), name="x")
    r = te.reduce_axis((0, blocks * 64), name="r")
    top = te.compute((2, 3), lambda h, i: te.max(x[h, i, r], axis=r), name="top")
    e = te.compute(x.shape, lambda h, i, j: te.exp(x[h, i, j] - top[h, i]), name="e")
    r2 = te.reduce_axis((0, blocks * 64), name="r2")
    total = te.compute((2, 3), lambda h, i: te.sum(e[h, i, r2], axis=r2), name="total")
    norm = te.compute(x.shape, lambda h, i, j: e[h, i, j] / total[h, i], name="norm")
    nan = te.compute(x.shape, lambda h, i, j: tirx.isnan(norm[h, i, j]), name="nan")
    y = te.compute(x.shape, lambda h, i, j: tirx.Select(nan[h, i, j], tirx.const(0.0, "float32"), norm[h, i, j]),
                   name="y")
    func = te.create_prim_func([x, y, blocks])
    scheduled = schedule_generic_func(func, 16)
    text = scheduled.script()
    assert is_scheduled(scheduled) and 'T.sblock("norm")' not in text and 'T.sblock("nan")' not in text
    assert 'T.sblock("e")' in text  # the exponentials stay computed once
    built, default = _compiled(scheduled), _compiled(func)
    rng = np.random.default_rng(9)
    a = (4 * rng.standard_normal((2, 3, 192))).astype(np.float32)
    a[1, 2] = -np.inf
    outs = []
    for module in (built, default):
        out = tvm.runtime.tensor(np.full_like(a, 7.0))
        module["main"](tvm.runtime.tensor(a), out, 3)
        outs.append(out.numpy())
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-7)
    assert (outs[0][1, 2] == 0).all() and np.isfinite(outs[0]).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_isnan_is_a_vector_bit_test(dtype):
    """torch's attention exports guard softmax with where(isnan(p), 0, p): the rule rewrites
    isnan as a test on the bits, so the loop is vectorized (TVM's vectorizer scalarized it
    whole), with numpy's isnan on every class of value: NaNs of any sign and payload, the
    infinities, the largest finite value, subnormals, zeros."""
    n = tirx.Var("n", "int64")
    x = te.placeholder((3, n), dtype, name="x")
    y = te.compute((3, n), lambda i, j: tirx.Select(tirx.isnan(x[i, j]), tirx.const(0, dtype), x[i, j]), name="y")
    scheduled = schedule_generic_func(te.create_prim_func([x, y]), lanes=16)
    assert is_scheduled(scheduled)
    script = scheduled.script()
    assert "isnan" not in script and "T.vectorized" in script
    built = _compiled(scheduled)
    info = np.finfo(dtype)
    bits = np.dtype(f"uint{info.bits}")
    nan_bits = np.array([np.nan, -np.nan], dtype).view(bits)
    quiet = bits.type(1 << (info.nmant - 1))
    payloads = np.concatenate([nan_bits | 1, (nan_bits ^ quiet) | 1]).view(dtype)  # quiet and signalling
    special = np.concatenate([np.array([np.nan, -np.nan, np.inf, -np.inf, info.max, -info.max, info.tiny,
                                        info.smallest_subnormal, -info.smallest_subnormal, 0.0, -0.0, 1.5], dtype),
                              payloads])
    assert np.isnan(payloads).all()
    for cols in (len(special), 37, 64):
        a = np.resize(special, 3 * cols).reshape(3, cols).astype(dtype)
        out = tvm.runtime.tensor(np.ones_like(a))
        built["main"](tvm.runtime.tensor(a), out)
        want = np.where(np.isnan(a), np.zeros_like(a), a)
        np.testing.assert_array_equal(out.numpy().view(bits), want.view(bits))


def test_q_k_transposed_prefetches_its_key_rows():
    """q @ K^T over keys kept transposed ([kv heads, head dim, 64 x blocks], the KV step's
    layout): a tile reads one line of each of the head dim's rows, so a loop before the
    reduction prefetches each row's line 4 lines ahead (the reduction loop itself stays free
    of calls, so its register tile is not spilled), for grouped-query rows and for one row a
    head alike, on the first row tile only. Same numbers as numpy, also where the prefetch runs
    past the end of the keys; a constant key count gets no prefetch."""
    from schedules.x86_generic import PREFETCH_MARK

    blocks, n_keys = tirx.Var("kv_blocks", "int64"), tirx.Var("n", "int64")
    # grouped-query rows: whole tiles; one row per head: q padded to a tile, the keys read as
    # they are; a key count not a multiple of the vector: the keys' padded copy (just written,
    # in cache) is not prefetched
    for length, rows, marked in ((blocks * 64, 8, True), (blocks * 64, 1, True), (128, 8, False),
                                 (n_keys, 8, False)):
        q = te.placeholder((1, 4, rows, 64), name="q")
        keys = te.placeholder((1, 4, 64, length), name="keys")
        r = te.reduce_axis((0, 64), name="r")
        scores = te.compute((1, 4, rows, length),
                            lambda b, h, i, j: te.sum(q[b, h, i, r] * keys[b, h, r, j], axis=r), name="scores")
        with_blocks = not isinstance(length, (int, tirx.Var))
        func = te.create_prim_func([q, keys, scores, blocks] if with_blocks else [q, keys, scores])
        scheduled = schedule_generic_func(func, 16)
        text = scheduled.script()
        assert is_scheduled(scheduled) and PREFETCH_MARK not in text
        assert ("llvm.prefetch" in text) == marked
        if marked:  # the prefetch loop, then the reduction loop holding no call
            fetch, reduce = text.index("for r_ahead in range(64)"), text.index("for r in range(64)")
            assert fetch < reduce and "llvm.prefetch" not in text[reduce:]
            assert "T.address_of(keys[b, h, r_ahead, j_0 * T.int64(16) + T.int64(64)]), 0, 2, 1)" in text[fetch:reduce]
            if rows == 8:  # two row tiles read the same keys: the second finds them in cache
                assert text.rindex("if i_0 == 0:", 0, fetch) > text.rindex("for i_0, j_0", 0, fetch)
        built = _compiled(scheduled)
        rng = np.random.default_rng(5)
        for n in ((64, 192, 1920) if with_blocks else (length,) if isinstance(length, int) else (37, 200)):
            a = rng.standard_normal((1, 4, rows, 64)).astype(np.float32)
            b = rng.standard_normal((1, 4, 64, n)).astype(np.float32)
            out = tvm.runtime.tensor(np.zeros((1, 4, rows, n), np.float32))
            built["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out, *([n // 64] if with_blocks else []))
            np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("keys_dtype", ["float32", "float16"])
def test_q_k_transposed_packs_key_panels_for_many_rows(keys_dtype):
    """Prefill's q @ K^T over the KV step's keys (64 x blocks): from 64 rows a head on, column
    tiles outermost, each tile's keys copied once into a contiguous panel that every row tile
    reads (the keys' rows, the key count apart, thrash L1 at 512 or 1024 keys); below (decode)
    the streaming nest with its key-row prefetch. Grouped-query rows (seq x 8 a kv head, whole
    tiles) and one row a head (MHA: q padded to whole tiles) alike. Both nests against numpy,
    at row counts either side of the threshold and key counts that alias in L1 (1024) or not;
    keys in float16 too (``--kv-cache fp16``: widened as read, the panel kept in float16)."""
    seq, blocks = tirx.Var("seq", "int64"), tirx.Var("kv_blocks", "int64")
    for group in (8, 1):
        q = te.placeholder((1, 4, seq * group, 64), name="q")
        keys = te.placeholder((1, 4, 64, blocks * 64), name="keys", dtype=keys_dtype)
        r = te.reduce_axis((0, 64), name="r")
        scores = te.compute((1, 4, seq * group, blocks * 64), lambda b, h, i, j: te.sum(
            q[b, h, i, r] * keys[b, h, r, j].astype("float32"), axis=r), name="scores")
        scaled = te.compute(scores.shape, lambda *i: scores(*i) * tirx.const(0.125, "float32"), name="scaled")
        scheduled = schedule_generic_func(te.create_prim_func([q, keys, scaled, seq, blocks]), 16)
        text = scheduled.script()
        packed, streamed = text.split("\n    else:\n")
        assert ("if seq * T.int64(8) >= T.int64(64):" if group == 8 else "if seq >= T.int64(64):") in packed
        assert 'T.sblock("keys_global")' in packed and "llvm.prefetch" not in packed
        panel = next(line for line in packed.splitlines() if "keys_global = T.sblock_alloc_buffer(" in line)
        assert panel.endswith('"float16")') == (keys_dtype == "float16"), panel  # the cache's bytes, not widened
        assert "keys_global" not in streamed and "llvm.prefetch" in streamed
        built = _compiled(scheduled)
        rng = np.random.default_rng(group)
        for s, n in ((1, 1024), (7, 192), (8, 1024), (8, 64), (33, 1088), (70, 1024)):
            a = rng.standard_normal((1, 4, s * group, 64)).astype(np.float32)
            b = rng.standard_normal((1, 4, 64, n)).astype(keys_dtype)
            out = tvm.runtime.tensor(np.full((1, 4, s * group, n), np.nan, np.float32))
            built["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out, s, n // 64)
            np.testing.assert_allclose(out.numpy(), (a @ b.astype(np.float32)) * 0.125, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lanes", [16, 8])
def test_q_k_padded_keys_copy_has_skewed_rows(lanes):
    """One row a head (MHA: GPT-2, LLaMA-2) over keys of any count: q and the keys are padded
    copies, and the keys copy's row pitch is never a multiple of 512 floats (``storage_align``):
    at 1024 or 2048 keys a tile's 64 rows fell in one L1 set and every row tile re-read them
    from L2. Against numpy with the causal mask fused, past > 0, at key counts whose padded
    pitch is a multiple of 512 (1024, 2048) and not, one row (decode) and many."""
    seq, past = tirx.Var("seq", "int64"), tirx.Var("past", "int64")
    q = te.placeholder((1, 3, seq, 64), name="q")
    keys = te.placeholder((1, 3, 64, past + seq), name="keys")
    mask = te.placeholder((1, 1, seq, past + seq), name="mask")
    r = te.reduce_axis((0, 64), name="r")
    scores = te.compute((1, 3, seq, past + seq),
                        lambda b, h, i, j: te.sum(q[b, h, i, r] * keys[b, h, r, j], axis=r), name="scores")
    masked = te.compute(scores.shape, lambda b, h, i, j: scores[b, h, i, j] * tirx.const(0.125, "float32")
                        + mask[b, 0, i, j], name="masked")
    scheduled = schedule_generic_func(te.create_prim_func([q, keys, mask, masked, past]), lanes)
    text = scheduled.script()
    assert is_scheduled(scheduled) and 'T.sblock("keys_pad")' in text
    assert f'"buffer_dim_align": [[0, 2, 512, {lanes}]]' in text.split('T.sblock("keys_pad")')[1].split("T.sblock(")[0]
    built = _compiled(scheduled)
    rng = np.random.default_rng(11)
    for s, p in ((1024, 0), (1, 1023), (5, 2043), (512, 0), (37, 70), (1, 99)):
        n = p + s
        a = rng.standard_normal((1, 3, s, 64)).astype(np.float32)
        b = rng.standard_normal((1, 3, 64, n)).astype(np.float32)
        m = np.triu(np.full((s, n), -1e9, np.float32), p + 1)[None, None]
        out = tvm.runtime.tensor(np.full((1, 3, s, n), np.nan, np.float32))
        built["main"](*(tvm.runtime.tensor(v) for v in (a, b, m)), out, p)
        np.testing.assert_allclose(out.numpy(), (a @ b) * 0.125 + m, rtol=1e-4, atol=1e-3)


_SCALAR_THEN_MASK = '''
# from tvm.script import tirx as T
@T.prim_func(s_tir=True)
def main(past: T.Buffer((T.int64(1),), "int64"), x: T.Buffer((T.int64(4), "blocks * T.int64(16)"), "float32"),
         blocks: T.int64, y: T.Buffer((T.int64(4), blocks * T.int64(16)), "float32")):
    scalar = T.sblock_alloc_buffer((), "int64")
    with T.sblock("scalar"):
        vi = T.axis.spatial(T.int64(1), T.int64(0))
        scalar[()] = past[T.int64(0)]
    for i, j in T.grid(T.int64(4), blocks * T.int64(16)):
        with T.sblock("masked"):
            vi, vj = T.axis.remap("SS", [i, j])
            y[vi, vj] = T.Select(vj <= scalar[()] + vi, x[vi, vj], T.float32(-3.0e38))
'''


def test_a_scalar_written_without_a_loop_does_not_stop_the_rule():
    """A KV step's causal mask starts from the past length reshaped to a 0-d tensor, a block
    with a unit iterator and no loop: the rule took it for a transformed nest and left the
    whole function to TVM's scalar serial loops (a 1024-token prefill's mask add, 1.4x slower).
    Scheduled now, vectorized, with the default loops' numbers (serial, and parallel over
    rows from 2^18 elements: ``_parallel_injective``)."""
    func = tvm.script.from_source(_SCALAR_THEN_MASK)
    scheduled = schedule_generic_func(func, 16)
    assert scheduled is not None and is_scheduled(scheduled) and "T.vectorized" in scheduled.script()
    built = [_compiled(f)["main"] for f in (func, scheduled)]
    rng = np.random.default_rng(3)
    for blocks, past in ((1, 0), (3, 5), (4, 63), (4096, 1000)):  # the last: 2^18 elements, parallel
        x = tvm.runtime.tensor(rng.standard_normal((4, 16 * blocks)).astype(np.float32))
        outs = [tvm.runtime.tensor(np.full((4, 16 * blocks), np.nan, np.float32)) for _ in built]
        for fn, out in zip(built, outs):
            fn(tvm.runtime.tensor(np.array([past], np.int64)), x, blocks, out)
        np.testing.assert_array_equal(outs[0].numpy(), outs[1].numpy())
