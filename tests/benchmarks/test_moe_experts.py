"""benchmarks/moe_experts.py at toy sizes: it compiles its three artefacts, times every engine at
each thread count and token count, and writes its table as JSON; the packed engine's error
against onnxruntime's fp32 is the format's, the float one's float rounding."""
from __future__ import annotations

import json

from benchmarks import moe_experts


def test_tiny_run_writes_json(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert moe_experts.main(["--threads", "1", "--layers", "2", "--experts", "3", "--k", "128", "--n", "96",
                             "--top", "2", "--tokens", "1", "3", "--calls", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["tokens"], r["engine"]) for r in rows} == {
        (t, e) for t in (1, 3) for e in ("qtvm int4-g128 experts packed", "qtvm int4-g128 packed, int8 act",
                                         "qtvm fp32 (experts gathered)", "onnxruntime fp32")}
    for r in rows:
        assert r["median_ms"] > 0 and r["rows"] == 2 * r["tokens"]
        if r["engine"] == "qtvm fp32 (experts gathered)":
            assert r["rel_err_vs_ort_fp32"] < 1e-5
        if "packed" in r["engine"]:
            assert 1e-4 < r["rel_err_vs_ort_fp32"] < 0.3  # int4's error, not a wrong kernel's
    assert "x vs ORT" in capsys.readouterr().out
