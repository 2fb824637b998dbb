"""notebooks/quickstart.ipynb: a clean nbformat-4 file whose code cells all run, in order, in one namespace.

No Jupyter needed: the .ipynb is read as JSON and each code cell is exec'd, as a kernel would run
"Restart & Run All". The values the notebook computes are then checked, so a notebook that runs but
shows a broken compiler (or an int8 option that stopped costing anything measurable) fails here.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"
CELL_KEYS = {"markdown": {"cell_type", "id", "metadata", "source"},
             "code": {"cell_type", "id", "metadata", "source", "execution_count", "outputs"}}


def load_notebook() -> dict:
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))


def cell_source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def test_notebook_is_nbformat4_without_outputs():
    nb = load_notebook()
    assert nb["nbformat"] == 4 and nb["nbformat_minor"] >= 5  # 4.5+: every cell has an id
    assert nb["metadata"]["kernelspec"]["language"] == "python"
    ids = [c["id"] for c in nb["cells"]]
    assert len(ids) == len(set(ids)), "cell ids must be unique"
    for i, cell in enumerate(nb["cells"]):
        assert cell["cell_type"] in CELL_KEYS, f"cell {i}: unexpected type {cell['cell_type']}"
        assert set(cell) == CELL_KEYS[cell["cell_type"]], f"cell {i}: keys {sorted(cell)}"
        assert isinstance(cell["source"], (str, list)) and cell_source(cell).strip(), f"cell {i} is empty"
        if cell["cell_type"] == "code":
            assert cell["execution_count"] is None, f"cell {i} has a stored execution count"
            assert cell["outputs"] == [], f"cell {i} has stored outputs"
            # exec() below runs plain Python: no IPython magics or shell escapes.
            assert not any(line.lstrip().startswith(("%", "!")) for line in cell_source(cell).splitlines())
    kinds = [c["cell_type"] for c in nb["cells"]]
    assert kinds.count("markdown") >= 5 and kinds.count("code") >= 5
    assert kinds[0] == "markdown", "the notebook opens by saying what it is"


@pytest.fixture
def restore_environ():
    """The notebook imports qtvm.runtime, which sets TVM_USE_RUNTIME_LIB; keep it out of later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_notebook_runs_top_to_bottom(restore_environ):
    ns: dict = {"__name__": "__main__"}
    try:
        for index, cell in enumerate(load_notebook()["cells"]):
            if cell["cell_type"] != "code":
                continue
            exec(compile(cell_source(cell), f"{NOTEBOOK.name}[cell {index}]", "exec"), ns)  # noqa: S102
    finally:
        if "workdir" in ns:  # a failing cell must not leave the artefacts behind
            ns["workdir"].cleanup()

    # Everything was written under the TemporaryDirectory, and the last cell removed it.
    assert not ns["WORK"].exists()

    # Section 2: stored bits/weight include scales, zeros and K padding (K = 704 -> 768 for g128).
    qts = ns["quantized"]
    assert set(qts) == {"int4-g128", "int3-g128", "int2-g64"}
    assert qts["int4-g128"].bits_per_weight == pytest.approx((4 + 64 / 128) * 768 / 704)
    assert qts["int2-g64"].bits_per_weight == pytest.approx(3.0)

    # Section 3: the format description the schedule rule reads is attached to the kernel.
    desc = ns["scheduled"].attrs["qtvm.format"]
    assert (int(desc["bits"]), int(desc["group"]), int(desc["padded_k"])) == (4, 128, 768)
    assert "T.parallel" in ns["script"] and "T.vectorized" in ns["script"]

    # Section 4: one artefact serves both shapes; fp32 activations match ORT on the dequantized
    # model to float rounding; int8 activations cost a visible but bounded error.
    assert set(ns["errors"]["fp32"]) == set(ns["SHAPES"]) and len(ns["SHAPES"]) == 2
    assert ns["max_rel_err_fp32"] < 1e-4
    assert ns["max_rel_err_int8"] < 0.1

    # Section 5: the GEMV kernel ran and was timed.
    assert ns["us_int4"] > 0 and ns["us_numpy"] > 0
    assert ns["gemv_format_err"] < 0.3  # int4-g128 vs fp32 weights on a random 4096 x 4096 matrix
