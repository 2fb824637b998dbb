"""The weights blob: what is written is read back, bit for bit, with its table."""
import ctypes

import numpy as np
import pytest
import tvm

from qtvm.deploy import weights


def test_blob_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 5)).astype("float32"), rng.integers(-9, 9, (7,), dtype=np.int32),
              rng.integers(0, 255, (2, 3, 11), dtype=np.uint8), rng.standard_normal((4,)).astype("float16")]
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    size = weights.write_blob(tensors, tmp_path / "w.bin")
    data = (tmp_path / "w.bin").read_bytes()
    assert len(data) == size
    data_start, table = weights.read_table(lambda off, n: data[off:off + n])
    assert data_start % weights.DATA_ALIGN == 0
    for a, e in zip(arrays, table):
        assert e.offset % weights.WEIGHT_ALIGN == 0 and e.shape == a.shape and e.dtype == str(a.dtype)
        got = np.frombuffer(data, dtype=a.dtype, count=a.size, offset=data_start + e.offset).reshape(a.shape)
        np.testing.assert_array_equal(got, a)
    # the loader's copy, from the blob in memory (as dlsym finds it in a library)
    buf = ctypes.create_string_buffer(data, len(data))
    loaded = weights.LoadedWeights(ctypes.addressof(buf))
    for a, t in zip(arrays, loaded.tensors):
        np.testing.assert_array_equal(t.numpy(), a)


def test_a_blob_of_something_else_is_refused():
    with pytest.raises(ValueError, match="not a qtvm weights blob"):
        weights.read_table(lambda off, n: b"\0" * n)
