"""`qtvm bench prefill`: every kernel computes what its own weights say; bad options
fail in one line through the real CLI; a tiny run writes valid JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from qtvm.bench import prefill

K, N = 256, 64


@pytest.fixture(scope="module")
def kernels():
    W = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)
    return prefill.make_kernels(W, ["int4-g128"], ["fp32", "int8"], list(prefill.PEERS), threads=1)


def test_kernel_set(kernels):
    assert [(k.name, k.is_qtvm) for k in kernels] == [
        ("qtvm fp32-act", True), ("qtvm int8-act", True), ("torch fp32 mm", False),
        ("torch int4 mm (bf16)", False), ("ort MatMulNBits acc4", False)]
    assert [k.tol for k in kernels] == [1e-4, 2e-2, 1e-4, 2e-2, 2e-2]


@pytest.mark.parametrize("m", [3, 5, 17])
def test_every_kernel_matches_its_reference(kernels, m):
    x = np.random.default_rng(m).standard_normal((m, K)).astype(np.float32)
    for k in kernels:
        err = prefill.check(k, x)  # raises past the kernel's tolerance
        assert k.output().shape == (m, N)
        if k.name.startswith("qtvm") or k.name.startswith("ort"):
            assert err < 1e-5, (k.name, err)  # exact up to summation order against the rounded activations


def test_int8_reference_is_not_the_fp32_one(kernels):
    """The int8 kernel is checked against int8-rounded activations, which differ from fp32 ones."""
    x = np.random.default_rng(9).standard_normal((5, K)).astype(np.float32)
    q8 = kernels[1]
    rounded, exact = q8.reference(x), x.astype(np.float64) @ q8.qt.dequantize().astype(np.float64)
    assert 1e-5 < np.abs(rounded - exact).max() / np.abs(exact).max() < 2e-2


def test_int8_kernel_3bit_padded_k():
    """3-bit codes are relaid into byte planes for the int8 path; K=300 is padded to whole groups."""
    from qtvm.formats import get_format

    rng = np.random.default_rng(3)
    qt = get_format("int3-g64").quantize(rng.standard_normal((300, 40)).astype(np.float32))
    for act in ("fp32", "int8"):
        k = prefill.QtvmPrefill(qt, act, "int3-g64")
        assert prefill.check(k, rng.standard_normal((6, 300)).astype(np.float32)) < 1e-5


def test_check_fails_loudly_on_a_wrong_kernel(kernels):
    class Off(prefill.TorchFp32Mm):
        def output(self):
            return super().output() * 1.01

    bad = Off(np.random.default_rng(0).standard_normal((K, N)).astype(np.float32))
    with pytest.raises(AssertionError, match="disagrees with its reference"):
        prefill.check(bad, np.ones((3, K), np.float32))


def test_speedups_are_relative_to_the_best_qtvm_row():
    rows = [{"kernel": n, "fmt": "f", "qtvm": q, "K": 1, "N": 1, "M": 4, "threads": 1, "median_ms": ms, "gflops": 1.0}
            for n, q, ms in [("a", True, 2.0), ("b", True, 1.0), ("peer", False, 3.0)]]
    assert [r["best_qtvm_speedup"] for r in prefill.add_speedups(rows)] == [2.0, 1.0, 3.0]
    assert "3.00x" in prefill.format_table(rows)


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "qtvm.cli", "bench", "prefill", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=600, check=False)


@pytest.mark.parametrize("argv,needles", [
    (["--shapes", "4096by4096"], ["is not KxN"]),
    (["--rows", "0"], ["--rows must be >= 1"]),
    (["--peers", "numpy"], ["unknown peers: numpy"]),
    (["--threads", "0"], ["--threads must be >= 1"]),
    (["--rounds", "0"], ["--rounds must be >= 1"]),
    (["--act", "fp16"], ["--act takes"]),
    (["--quiet-wait", "-1"], ["--quiet-wait must be >= 0"]),
    (["--formats", "int9-g7"], ["unknown quant preset 'int9-g7'"]),
    (["--formats", "int8-g128", "--act", "int8"], ["format int8-g128 has no int8-activation kernel", "int4-g128",
                                                   "--act fp32"]),
    (["--shapes", "256x40"], ["torch_int4 cannot take shape 256x40"]),
])
def test_bad_options_fail_in_one_line(argv, needles, tmp_path):
    out = tmp_path / "sub" / "b.json"
    proc = cli(*argv, "--json", out)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qtvm: error:") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists()


def test_tiny_run_writes_json(tmp_path):
    out = tmp_path / "prefill.json"
    proc = cli("--shapes", "256x64", "--rows", "5", "--rounds", "1", "--threads", "1", "--budget", "0.01",
               "--quiet-wait", "0", "--json", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["benchmark"] == "prefill" and doc["meta"]["cpu_model"] and doc["meta"]["n_cpus"]
    res = doc["results"]
    assert len(res) == 5 and {r["kernel"] for r in res} >= {"qtvm fp32-act", "qtvm int8-act", "torch fp32 mm"}
    for r in res:
        assert (r["K"], r["N"], r["M"], r["threads"]) == (256, 64, 5, 1)
        assert r["median_ms"] > 0 and r["gflops"] > 0 and r["best_qtvm_speedup"] >= 1 - 1e-12
    assert "GFLOP/s" in proc.stdout and "best qtvm speed-up" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["prefill.json"]  # no temporary file left behind


def test_registered_next_to_gemv_without_importing_tvm():
    code = ("import sys, qtvm.cli; p = qtvm.cli.build_parser(); "
            "a = p.parse_args(['bench', 'prefill']); b = p.parse_args(['bench', 'gemv']); "
            "print(a.fn.__name__, b.fn.__name__, a.rows, 'tvm' in sys.modules, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.stdout.split() == ["prefill_command", "bench_command", "[16,", "64,", "128]", "False", "False"], proc


def test_in_process_ort_peer_leaves_later_sessions_alone(kernels):
    """The shared ORT pool is for the benchmark's child process only: once made it is for
    good, and every later default session in the process would fail to load."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0].tolist() == [0.0, 2.0]


def test_time_interleaved_rotates_the_order_each_round(monkeypatch):
    """Kernels take turns A B C, B C A, C A B: none always runs first (or last) in a round."""
    from qtvm.bench import prefill

    monkeypatch.setattr(prefill.time, "sleep", lambda s: None)
    calls = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def run(self):
            calls.append(self.name)

    out = prefill.time_interleaved([Kernel("a"), Kernel("b"), Kernel("c")], rounds=3, budget_s=0.0, min_calls=1,
                                   warmup_s=0.0)
    timed = calls[6:]  # two warm-up calls each
    firsts = [timed[i] for i in range(0, len(timed), 2)]  # each turn: one untimed call, one timed
    assert firsts == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [len(times) for times, _ in out] == [3, 3, 3]
