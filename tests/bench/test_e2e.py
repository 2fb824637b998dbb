"""`qtvm bench e2e` on a tiny model: the table and JSON it writes, and a rerun served from
its cache (speed is the benchmark's business, not the test's)."""
from __future__ import annotations

import json

import pytest

from qtvm.cli import main

TINY = ["--hidden", "64", "--layers", "2", "--intermediate", "96", "--vocab", "256", "--heads", "4",
        "--kv-heads", "2", "--prompt", "5", "--decode", "3", "--rounds", "1", "--threads", "1",
        "--engines", "qtvm-int4,ort-fp32,ort-int4"]


def test_e2e_table_json_and_cache(tmp_path, capsys):
    cache, out = tmp_path / "cache", tmp_path / "e2e.json"
    assert main(["bench", "e2e", *TINY, "--cache-dir", str(cache), "--json", str(out)]) == 0
    first = capsys.readouterr().out
    assert "exported" in first and "compiled" in first and "quantized" in first
    lines = first.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("engine"))
    assert "prefill tok/s" in lines[header] and "decode vs ort int4" in lines[header]
    labels = [line.split("  ")[0] for line in lines[header + 2:header + 5]]
    assert labels == ["qtvm int4-g128", "ort fp32", "ort int4 (MatMulNBits acc=4)"]
    doc = json.loads(out.read_text())
    assert doc["meta"]["benchmark"] == "e2e" and doc["meta"]["cpu_model"] and "isa" in doc["meta"]
    assert doc["meta"]["model"]["hidden"] == 64 and doc["meta"]["prompt"] == 5
    rows = {r["engine"]: r for r in doc["results"]}
    assert set(rows) == {"qtvm-int4", "ort-fp32", "ort-int4"}
    for r in rows.values():
        assert r["threads"] == 1 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        assert len(r["round_decode_ms"]) == 1 and 0.9 < r["logits_cosine_vs_ort_fp32"] <= 1.0 + 1e-6
    assert rows["ort-fp32"]["decode_x_ort-fp32"] == pytest.approx(1.0)
    built = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert main(["bench", "e2e", *TINY, "--cache-dir", str(cache), "--json", str(out)]) == 0
    again = capsys.readouterr().out
    assert "exported" not in again and "compiled" not in again and "quantized" not in again
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == built


def test_e2e_bad_options(capsys):
    assert main(["bench", "e2e", "--hidden", "65", "--heads", "4"]) == 2
    assert "must be a multiple of --heads" in capsys.readouterr().err
    assert main(["bench", "e2e", "--engines", "ort-fp32,llama.cpp"]) == 2
    assert "unknown engines: llama.cpp" in capsys.readouterr().err


def test_e2e_bcq_engines_on_request(tmp_path, capsys):
    """The BCQ builds (LUT-GEMM decode; ``--act int8``: int8 nibble tables where the CPU has
    AVX-512 VBMI + VNNI, int16 tables where it has AVX-512BW, else fp32 tables with a note)
    generate and agree with onnxruntime fp32."""
    args = [a if a != "qtvm-int4,ort-fp32,ort-int4" else "qtvm-bcq3,qtvm-bcq3-a8,ort-fp32" for a in TINY]
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", *args, "--cache-dir", str(tmp_path / "cache"), "--json", str(out)]) == 0
    rows = {r["engine"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"qtvm-bcq3", "qtvm-bcq3-a8", "ort-fp32"}
    assert [rows[e]["label"] for e in ("qtvm-bcq3", "qtvm-bcq3-a8")] == ["qtvm bcq3-g128", "qtvm bcq3-g128 --act int8"]
    for name in ("qtvm-bcq3", "qtvm-bcq3-a8"):
        assert rows[name]["decode_tok_s"] > 0 and 0.9 < rows[name]["logits_cosine_vs_ort_fp32"] <= 1.0 + 1e-6
