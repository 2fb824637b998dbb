"""safetensors writer and reader (numpy only)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from qtvm.errors import QtvmError
from qtvm.safetensors import load_metadata, load_safetensors, save_safetensors


def test_round_trip_and_layout(tmp_path):
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([-7, 1 << 40], np.int64),
               "c": np.arange(5, dtype=np.float16), "d": np.array([[1, -2]], np.int32), "e": np.zeros((0, 4), np.uint8)}
    path = save_safetensors(tmp_path / "t.safetensors", tensors, {"checkpoint_format": "gptq"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0  # data starts 8-byte aligned
    header = json.loads(raw[8:8 + n])
    assert header["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    got = load_safetensors(path)
    assert list(got) == list(tensors)
    for name, a in tensors.items():
        assert got[name].dtype == a.dtype
        np.testing.assert_array_equal(got[name], a)
    assert load_metadata(path) == {"checkpoint_format": "gptq"}
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]  # no temp file left


def test_unstorable_dtype_leaves_nothing(tmp_path):
    with pytest.raises(QtvmError, match="dtype complex64"):
        save_safetensors(tmp_path / "t.safetensors", {"z": np.zeros(2, np.complex64)})
    assert list(tmp_path.iterdir()) == []


def test_missing_file(tmp_path):
    with pytest.raises(QtvmError, match="does not exist"):
        load_safetensors(tmp_path / "none.safetensors")
