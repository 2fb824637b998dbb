"""Every notebook in notebooks/ runs top to bottom under a real Jupyter kernel (nbclient +
ipykernel), is committed with its outputs (plots included), and those outputs are the current
code's: a fresh execution differs from them only where tests/notebooks/nbrun.py allows (timings,
the machine's CPU). After the last cell a probe reads values from the kernel, so a notebook that
runs but shows a broken compiler fails here too.

When code the notebooks show changes, regenerate them:
    PYTHONPATH=$PWD python3 -m tests.notebooks.nbrun notebooks/*.ipynb
"""
from __future__ import annotations

import json

import nbformat
import pytest

from tests.notebooks import nbrun

NOTEBOOKS = sorted(p.name for p in nbrun.NOTEBOOKS.glob("*.ipynb"))

# Per notebook: Python run in the kernel after the last cell; it prints one JSON object.
PROBES = {
    "quickstart.ipynb": """
import json
qts = quantized
desc = scheduled.attrs["qtvm.format"]
print(json.dumps({
    "workdir_gone": not WORK.exists(),
    "presets": sorted(qts),
    "bits_int4": qts["int4-g128"].bits_per_weight, "bits_int2": qts["int2-g64"].bits_per_weight,
    "desc": [int(desc["bits"]), int(desc["group"]), int(desc["padded_k"])],
    "parallel": "T.parallel" in script and "T.vectorized" in script,
    "shapes": len(SHAPES), "err_fp32": max_rel_err_fp32, "err_int8": max_rel_err_int8,
    "us": [us_int4, us_numpy], "gemv_format_err": gemv_format_err}))
""",
    "formats.ipynb": """
import json
print(json.dumps({"results": results, "mae_ratio": mae["e0m4-g128"] / mae["int4-g128"],
                  "unpack_ok": list(map(int, reference)) == codes}))
""",
    "schedule_x86_gemv.ipynb": """
import json
print(json.dumps({
    "step_errors": [t.max_rel_err for t in timed], "steps": len(steps),
    "final": final.counts, "vnni": explore.kernel("int4-g128", k=K, n=N, target="llvm -mcpu=icelake-server",
                                                 activations="int8").source().counts,
    "avx2": avx2.source().counts,
    "compare": {n: (t.max_rel_err if t else None) for n, t, _, _ in cmp.rows},
    "roof_gbps": roof.bandwidth_gbps, "dlight": g.available()["dlight"], "cuda": cuda.kind}))
""",
    "tuning.ipynb": """
import json
print(json.dumps({"measured": report.measured, "history": len(conv.points),
                  "errors": {n: t.max_rel_err for n, t, _, _ in cmp.rows if t is not None},
                  "tuned_knobs": kernel_knobs(k.schedule("tuned"))}))
""",
    "generate.ipynb": """
import json
print(json.dumps({"same": {kv: int((t == reference).sum()) for kv, t in tokens.items()}, "new": NEW,
                  "fp16_error": fp16_error, "top1": top1, "workdir_gone": not Path(work.name).exists(),
                  "medians": {kv: float(np.median(t)) for kv, t in per_token.items()}}))
""",
    "compile_and_check.ipynb": """
import json
print(json.dumps({act: [r.ok, r.tolerance, [row.err_own for row in r.rows], len(r.rows)]
                  for act, r in reports.items()}))
""",
}


def _check_values(name: str, v: dict) -> None:
    if name == "quickstart.ipynb":
        assert v["workdir_gone"] and v["presets"] == ["int2-g64", "int3-g128", "int4-g128"]
        assert v["bits_int4"] == pytest.approx((4 + 64 / 128) * 768 / 704) and v["bits_int2"] == pytest.approx(3.0)
        assert v["desc"] == [4, 128, 768] and v["parallel"] and v["shapes"] == 2
        assert v["err_fp32"] < 1e-4 and v["err_int8"] < 0.1
        assert min(v["us"]) > 0 and v["gemv_format_err"] < 0.3
    elif name == "formats.ipynb":
        bits = {p: r[0] for p, r in v["results"].items()}
        assert bits["int4-g128"] == pytest.approx(4.5) and bits["int2-g64"] == pytest.approx(3.0)
        assert bits["int3-g128"] == pytest.approx(3.5) and bits["bcq3-g128"] == pytest.approx(4.0)
        errs = {p: r[1] for p, r in v["results"].items()}
        assert errs["int8-g128"] < errs["int4-g128"] < errs["int3-g128"] < errs["int2-g64"]
        assert v["unpack_ok"] and v["mae_ratio"] < 1.0  # E0M4 below INT4 at group 128 (Transformer-Lite)
    elif name == "schedule_x86_gemv.ipynb":
        assert v["steps"] >= 10 and len(v["step_errors"]) == v["steps"] + 1
        assert max(v["step_errors"]) < 1e-5  # every intermediate schedule computes the same thing
        assert v["final"]["T.parallel"] == 1 and v["final"]["T.vectorized"] >= 1
        assert v["vnni"].get("vpdpbusd", 0) > 0 and v["avx2"].get("vfmadd213ps", 0) + v["avx2"].get("vfmadd231ps", 0) > 0
        assert v["compare"]["analytic"] < 1e-5 and v["compare"]["tvm-default"] < 1e-5
        assert v["compare"]["dlight"] is None and v["roof_gbps"] > 0
        assert v["dlight"] == "" and v["cuda"] == "cuda"
    elif name == "tuning.ipynb":
        assert v["measured"] > 0 and v["history"] > 0
        assert set(v["errors"]) == {"analytic", "tuned", "tvm-default"} and max(v["errors"].values()) < 1e-5
        assert set(v["tuned_knobs"]) == {"tile_cols", "unroll", "local_partials", "parallel"}
    elif name == "compile_and_check.ipynb":
        for act, (ok, tol, errs, rows) in v.items():
            assert ok and rows == 3 and max(errs) <= tol, (act, errs)
        assert max(v["fp32"][2]) < 1e-4
    elif name == "generate.ipynb":
        assert v["same"] == {"model": v["new"], "fp16": v["new"]}  # greedy tokens: onnxruntime's, both caches
        assert 0 < v["fp16_error"] < 1e-2 and v["top1"] >= 0.95  # float16 caches: used, and close
        assert v["workdir_gone"] and min(v["medians"].values()) > 0
    else:
        raise AssertionError(f"{name} has no value checks: add them to tests/notebooks/test_notebooks.py")


def test_every_notebook_has_a_probe():
    assert set(NOTEBOOKS) == set(PROBES), "add a probe and value checks for each new notebook"
    assert len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_with_outputs(name):
    nb = nbformat.read(str(nbrun.NOTEBOOKS / name), as_version=4)
    nbformat.validate(nb)
    assert nb.cells[0].cell_type == "markdown", "a notebook opens by saying what it is"
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"not executed top to bottom in one kernel: {counts}"
    for c in code:
        assert not any(o.output_type == "error" for o in c.outputs), c.source[:80]
    assert sum(bool(c.outputs) for c in code) >= len(code) - 1  # at most a clean-up cell prints nothing
    if name != "quickstart.ipynb":
        images = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
        assert images >= 1, "the notebook shows its results as plots too"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes_and_matches_its_committed_outputs(name):
    path = nbrun.NOTEBOOKS / name
    committed = nbformat.read(str(path), as_version=4)
    fresh, seconds, probe = nbrun.execute(path, PROBES[name])
    _check_values(name, json.loads(probe))
    problems = nbrun.differences(committed, fresh)
    assert not problems, (f"{name}: committed outputs are not the current code's (regenerate with "
                          f"`PYTHONPATH=$PWD python3 -m tests.notebooks.nbrun notebooks/{name}`):\n" + "\n".join(problems))
    assert seconds < 240, f"{name} took {seconds:.0f} s; keep notebook sizes small"


def test_differences_sees_a_changed_number_and_ignores_timings():
    """The comparison itself: a changed result fails, a changed timing in a tagged cell does not."""
    nb = nbformat.v4.new_notebook()
    fixed = nbformat.v4.new_code_cell("x")
    timed = nbformat.v4.new_code_cell("t")
    timed.metadata["tags"] = [nbrun.MACHINE_TAG]
    nb.cells = [fixed, timed]

    def with_outputs(a: str, b: str):
        out = nbformat.from_dict(json.loads(json.dumps(nb)))
        out.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=a)]
        out.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=b)]
        return out

    base = with_outputs("bits 4.500 err 0.1068\n", "analytic 25.4 us on znver5\n")
    assert nbrun.differences(base, with_outputs("bits 4.500 err 0.10681\n", "analytic 31.9 us on skylake-avx512\n")) == []
    assert nbrun.differences(base, with_outputs("bits 4.750 err 0.1068\n", "analytic 25.4 us on znver5\n"))
    assert nbrun.differences(base, with_outputs("bits 4.500 error 0.1068\n", "analytic 25.4 us on znver5\n"))
    assert nbrun.differences(base, with_outputs("bits 4.500 err 0.1068\n", "tuned 25.4 us on znver5\n"))
