from __future__ import annotations

import json
import math
import os

import pytest
import torch

from qtvm.bench import harness
from qtvm.bench.bandwidth import l3_cache_bytes


class _Token:
    def __init__(self, i):
        self.i = i
        self.calls = 0


@pytest.mark.parametrize("bytes_per_copy", [1 << 20, 8_400_000, 64 << 20, 180_355_072])
def test_rotation_exceeds_4x_l3_and_600mb(bytes_per_copy):
    made = []
    copies = harness.rotating_copies(lambda i: made.append(i) or _Token(i), bytes_per_copy)
    n = len(copies)
    assert made == list(range(n))
    total = n * bytes_per_copy
    assert total > 4 * l3_cache_bytes()
    assert total >= 600_000_000
    # and not wastefully many: one copy fewer would miss a bound (or the 2-copy floor)
    assert n == 2 or (n - 1) * bytes_per_copy <= max(4 * l3_cache_bytes(), 600_000_000 - 1)


def test_rotation_with_explicit_l3_and_floor():
    assert harness.rotation_count(10, 0, l3_bytes=100) == 41  # > 400 bytes
    assert harness.rotation_count(10, 1000, l3_bytes=100) == 100
    assert harness.rotation_count(1000, 0, l3_bytes=10) == 2
    with pytest.raises(ValueError):
        harness.rotating_copies(_Token, 1, l3_bytes=1 << 30, max_copies=10)


def test_time_rotating_cycles_all_copies():
    copies = [_Token(i) for i in range(5)]
    order = []

    def call(c):
        c.calls += 1
        order.append(c.i)

    times = harness.time_rotating(call, copies, warmup=3, iters=12)
    assert len(times) == 12 and all(t >= 0 for t in times)
    # touch_all: warm-up extended to 5 calls so every copy ran before timing
    assert len(order) == 5 + 12
    assert order == [i % 5 for i in range(17)]
    assert min(c.calls for c in copies) >= 3


def test_time_rotating_measures_time():
    import time as _t

    times = harness.time_rotating(lambda c: _t.sleep(0.002), [1, 2], warmup=0, iters=3, touch_all=False)
    assert all(0.0015 < t < 0.5 for t in times)


def _results():
    return [
        harness.BenchResult.from_times("torch_fp32_mv", (4096, 4096), "fp32", 1, [0.004, 0.005, 0.006], 4096 * 4096 * 4, 20.0),
        harness.BenchResult.from_times("ours", (4096, 4096), "int4_g128", 1, [0.001, 0.001], 8_650_752, 20.0, note="x"),
        harness.BenchResult.from_times("torch_fp32_mv", (4096, 4096), "fp32", 2, [0.003], 4096 * 4096 * 4),
    ]


def test_result_record_math():
    r = _results()[0]
    assert r.median_us == pytest.approx(5000.0)
    assert r.gbps == pytest.approx(4096 * 4096 * 4 / 0.005 / 1e9)
    assert r.pct_of_bandwidth == pytest.approx(100 * r.gbps / 20.0)
    assert r.extras["n_samples"] == 3
    assert _results()[2].pct_of_bandwidth is None
    assert harness.BenchResult.from_dict(r.to_dict()) == r


def test_table_has_aligned_columns_and_ratios(capsys):
    text = harness.print_table(_results(), {1: 20.0, 2: 30.0}, baseline="torch_fp32_mv")
    out = capsys.readouterr().out
    assert text in out
    lines = text.splitlines()
    table = lines[:5]
    assert len({len(line) for line in table}) == 1, table  # aligned
    assert "median_us" in lines[0] and "GB/s" in lines[0] and "%BW" in lines[0] and "vs_base" in lines[0]
    ours = next(line for line in lines if line.startswith("ours"))
    assert "5.00x" in ours  # 5000 us baseline / 1000 us
    fp32_2 = lines[4]
    gbps = 4096 * 4096 * 4 / 0.003 / 1e9
    assert f"{gbps:.2f}" in fp32_2 and f"{100 * gbps / 30.0:.1f}" in fp32_2 and "1.00x" in fp32_2
    assert "30.0 GB/s" in lines[-1]


def test_write_json_atomic_and_parses(tmp_path):
    path = tmp_path / "sub" / "res.json"
    harness.write_json(_results(), path, {"read_bandwidth_gbps": {1: 20.0, 2: 30.5}, "note": "t"})
    doc = json.loads(path.read_text())
    assert [r["kernel"] for r in doc["results"]] == ["torch_fp32_mv", "ours", "torch_fp32_mv"]
    assert doc["results"][1]["shape"] == [4096, 4096]
    assert doc["results"][1]["extras"]["note"] == "x"
    m = doc["meta"]
    assert m["read_bandwidth_gbps"] == {"1": 20.0, "2": 30.5}
    assert m["note"] == "t"
    assert m["cpu_model"] and m["date"]
    assert set(m["versions"]) >= {"torch", "onnxruntime", "tvm"}
    assert m["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    assert os.listdir(path.parent) == ["res.json"]  # no temp file left
    # rewriting replaces the file whole
    harness.write_json(_results()[:1], path, {})
    assert len(json.loads(path.read_text())["results"]) == 1
    assert os.listdir(path.parent) == ["res.json"]


def test_write_json_failure_leaves_old_file_and_no_temp(tmp_path):
    path = tmp_path / "res.json"
    harness.write_json(_results(), path, {})
    before = path.read_text()
    with pytest.raises(TypeError):
        harness.write_json(_results(), path, {"bad": object()})
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["res.json"]


def test_threads_context_manager():
    old = torch.get_num_threads()
    with harness.threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == old


def _child_probe(a, b=0):
    # prints to stdout must not corrupt the JSON result
    print("noise on stdout")
    return {"sum": a + b, "tvm_threads": os.environ.get("TVM_NUM_THREADS"), "pid": os.getpid()}


def _child_fail():
    raise RuntimeError("boom in child")


def test_run_in_subprocess_roundtrip():
    res = harness.run_in_subprocess(
        "tests.bench.test_harness:_child_probe", {"a": 2, "b": 3}, harness.thread_env(2),
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), stream_stderr=False,
    )
    assert res["sum"] == 5
    assert res["tvm_threads"] == "2"
    assert res["pid"] != os.getpid()


def test_run_in_subprocess_reports_failure():
    with pytest.raises(RuntimeError, match="boom in child"):
        harness.run_in_subprocess(
            "tests.bench.test_harness:_child_fail", {}, {},
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), stream_stderr=False,
        )


def test_machine_meta_fields():
    m = harness.machine_meta({1: 1.5})
    assert m["read_bandwidth_gbps"] == {"1": 1.5}
    assert m["l3_bytes"] == l3_cache_bytes()
    assert m["cpu_id"].count(" family ") == 1 and " model " in m["cpu_id"]
    b = harness.cpu_busy_fraction(0.05)
    assert math.isnan(b) or 0.0 <= b <= 1.0


def test_table_extra_columns():
    rs = _results()
    rs[1].extras["pct_of_probe_bw"] = 42.25
    text = harness.format_table(rs, {}, extras=("pct_of_probe_bw",))
    assert "pct_of_probe_bw" in text.splitlines()[0]
    assert "42.2" in text.splitlines()[3] or "42.3" in text.splitlines()[3]


def test_table_and_json_name_k_and_n():
    """A result's shape is (N, K); the table shows K then N under those headers and the JSON
    carries ``k`` and ``n``, so a non-square row cannot be read the wrong way round (a docs table
    once swapped 4096 x 11008 and 11008 x 4096 by reading the JSON's shape as K x N)."""
    r = harness.BenchResult.from_times("k", (11008, 4096), "f", 1, [1e-3], 1000)
    header, _, row = harness.format_table([r]).splitlines()[:3]
    cells = dict(zip(header.split(), row.split()))
    assert (cells["K"], cells["N"]) == ("4096", "11008")
    d = r.to_dict()
    assert (d["k"], d["n"]) == (4096, 11008)
    assert harness.BenchResult.from_dict(json.loads(json.dumps(d))) == r


def test_wait_for_quiet_returns_quickly_when_allowed_no_wait():
    busy, waited = harness.wait_for_quiet(0.0, interval=0.05)
    assert waited < 1.0
    assert math.isnan(busy) or 0.0 <= busy <= 1.0
    busy, waited = harness.wait_for_quiet(5.0, threshold=1.0, interval=0.05)  # always quiet enough
    assert waited < 1.0


def _child_tensor_pages():
    import numpy as np
    import tvm

    from qtvm import hugepages

    t = tvm.runtime.tensor(np.ones(16 << 20, np.int32))  # 64 MiB: malloc maps it
    addr = np.from_dlpack(t).ctypes.data
    mapping = [r for r in hugepages.anonymous_ranges() if r[0] <= addr < r[1]]
    return {"huge": hugepages.huge_bytes(mapping)}


def _glibc_has_hugetlb_tunable() -> bool:
    name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    return name == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (2, 35)


@pytest.mark.parametrize("huge", [True, False])
def test_thread_env_puts_malloced_weights_on_the_pages_it_says(huge):
    """A TVM tensor (glibc malloc, as onnxruntime's weights) in a bench child: on huge pages
    with ``huge_pages``, on 4 KiB pages without, where the system's THP mode is 'madvise'."""
    from qtvm.hugepages import thp_mode

    env = harness.thread_env(1, huge_pages=huge)
    assert env["QTVM_HUGEPAGES"] == ("1" if huge else "0")
    assert ("glibc.malloc.hugetlb=1" in env.get("GLIBC_TUNABLES", "")) == huge
    res = harness.run_in_subprocess("tests.bench.test_harness:_child_tensor_pages", {}, env,
                                    cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                                    stream_stderr=False)
    mode = thp_mode()
    if huge and mode in ("madvise", "always") and _glibc_has_hugetlb_tunable():
        assert res["huge"] >= 32 << 20
    elif not huge and mode in ("madvise", "never"):
        assert res["huge"] == 0
    assert harness.pages_meta(huge)["thp_mode"] == mode
