"""qtvm.explore: steps replay the rule's schedule faithfully, every step computes the same thing,
timings check the output first, sources come with highlights, and targets this machine cannot
run still show their source."""
from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from tvm_ffi import structural_equal

from qtvm import explore
from qtvm.errors import QtvmError

matplotlib.use("Agg")

# Awkward on purpose: K = 200 is not a multiple of the group (128 -> padded 256) and N = 100 not of the
# 64-column block.
K, N = 200, 100


@pytest.fixture(scope="module")
def kern():
    return explore.kernel("int4-g128", k=K, n=N, target="host")


def test_steps_replay_the_analytic_schedule_exactly(kern):
    steps = kern.steps()
    assert [s.index for s in steps] == list(range(1, len(steps) + 1))
    assert structural_equal(steps[-1].func, kern.schedule("analytic"))
    assert {"split", "reorder", "parallel", "compute_at", "vectorize", "decompose_reduction"} <= {s.primitive for s in steps}
    assert steps[2].code.startswith("sch.parallel(")  # the Python a trace prints, one primitive per step
    assert "T.parallel" not in steps[1].tir.text and "T.parallel" in steps[2].tir.text


def test_every_step_computes_the_same_result(kern):
    """Scheduled vs unscheduled on the same weights: each intermediate TIR, built and run,
    against numpy on the dequantized weights (the output starts as NaN)."""
    timed = kern.time_steps(repeats=2)
    assert len(timed) == len(kern.steps()) + 1
    assert all(t.hot_us and t.hot_us > 0 for t in timed)
    assert max(t.max_rel_err for t in timed) < 1e-5
    assert "step 0: compute (no schedule)" in repr(timed)


def test_time_cold_and_hot_and_the_comparison(kern):
    t = kern.time("analytic", repeats=3, cold_bytes=8 << 20)
    assert t.copies >= 2 and t.cold_us > 0 and t.hot_us > 0 and t.max_rel_err < 1e-5
    assert t.weight_bytes == sum(a.nbytes for a in kern._inputs()[0])
    cmp = kern.compare(("analytic", "tvm-default", "dlight", "tuned"), cold=False, repeats=3)
    text, page = repr(cmp), cmp._repr_html_()
    assert "n/a: dlight schedules GPU targets" in text and "n/a: not tuned yet" in text
    assert page.count("<tr>") == 5 and "vfmadd" in page  # header + 4 schedules; every CI CPU has FMA
    assert [t.schedule for t in cmp.timings()] == ["analytic", "tvm-default"]
    ax = cmp.plot()
    assert len(ax.patches) == 4


def test_a_kernel_too_small_to_time_cold_says_what_to_pass(kern, monkeypatch):
    """On a CPU with a large L3 (480 MiB: 4x that is 109k copies of an 18 KB kernel) the rotation
    needs too many copies: one line naming cold_bytes, not the harness's ValueError; cold_bytes
    is the whole rotation there (it was a floor under 4x the L3, and failed the same way)."""
    from qtvm.bench import harness

    monkeypatch.setattr(harness, "l3_cache_bytes", lambda: 1 << 40)
    with pytest.raises(QtvmError, match="cannot time .* DRAM-cold: .*; pass cold_bytes="):
        kern.time("analytic", repeats=2)
    assert kern.time("analytic", repeats=2, cold_bytes=1 << 20).copies == -(-(1 << 20) // kern.time(
        "analytic", repeats=2, cold=False).weight_bytes)


def test_int8_activation_kernel_against_its_rounded_reference():
    k8 = explore.kernel("int4-g64", k=192, n=70, target="host", activations="int8")
    primitives = [step.primitive for step in k8.steps()]
    # the dot tensorized, then the rounding of x; the last: chunk claiming
    assert "tensorize" in primitives and "r_factor" in primitives[primitives.index("tensorize"):]
    assert primitives[-1] == "annotate"
    t = k8.time("analytic", cold=False, repeats=2)
    assert t.max_rel_err < 1e-5  # against int8-rounded activations @ dequantized weights


def test_source_highlights_and_html_escapes():
    vnni = explore.kernel("int4-g128", k=256, n=64, target="llvm -mcpu=icelake-server", activations="int8")
    asm = vnni.source()
    assert asm.counts.get("vpdpbusd", 0) > 0
    page = asm.excerpt("vpdpbusd")._repr_html_()
    assert "<mark" in page and "vpdpbusd</mark>" in page
    code = explore.Code("a <b> vpdpbusd", "asm", explore.HIGHLIGHT["asm"], "t")
    assert "&lt;b&gt;" in code._repr_html_() and code.counts == {"vpdpbusd": 1}


def test_gpu_target_shows_source_without_a_gpu():
    from qtvm.cuda import load_cuda_runtime

    load_cuda_runtime()  # as after any CUDA compile in this process (the driver, or qtvm's stub)
    g = explore.kernel("int4-g128", k=K, n=N, target="cuda -arch=sm_80")
    avail = g.available()
    assert avail["dlight"] == "" and avail["analytic"] == ""  # qtvm's GPU rules (schedules/gpu_gemv.py)
    src = g.source("dlight")
    assert src.kind == "cuda" and "__global__" in src.text
    src = g.source("analytic")
    assert src.kind == "cuda" and "__shfl_down_sync" in src.text  # the lanes' split-K sum
    assert len(g.steps("dlight")) > 0 and len(g.steps("analytic")) > 0
    assert "threadIdx.x" in g.schedule("analytic").script()
    with pytest.raises(QtvmError, match="no 'tuned' schedule"):
        g.schedule("tuned")
    with pytest.raises(QtvmError, match="target='host'"):
        g.time("dlight")
    assert "n/a" in repr(g.compare())  # no timings, one row per schedule


def test_roofline_with_a_given_bandwidth(kern):
    t = kern.time("analytic", cold=False, repeats=2)
    roof = kern.roofline([t], bandwidth_gbps=20.0, threads=1)
    assert roof.intensity(t) == pytest.approx(2 * K * N / t.bytes_moved)
    assert "20.0 GB/s" in repr(roof) and "<table>" in roof._repr_html_()
    roof.plot()


def test_bad_requests_name_the_fix():
    with pytest.raises(QtvmError, match="unknown quant preset"):
        explore.kernel("int5-g7")
    with pytest.raises(QtvmError, match="activations"):
        explore.kernel("int4-g128", k=64, n=64, activations="fp16")
    with pytest.raises(QtvmError, match="no int8-activation kernel"):
        explore.kernel("int8-g128", k=128, n=64, activations="int8")
    k = explore.kernel("int4-g128", k=64, n=64)
    with pytest.raises(QtvmError, match="unknown schedule"):
        k.schedule("fastest")
    with pytest.raises(QtvmError, match="call .tune"):
        k.convergence()
    assert np.isfinite(k.time("analytic", cold=False, repeats=1).max_rel_err)
