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


def test_file_weights_are_views_of_the_files_pages(tmp_path):
    """The KV check's load: tensors on the file's copy-on-write pages (no copy), found from the
    address of the blob in a mapping of the file, as in a loaded library; bfloat16 (which numpy
    lays out otherwise) is copied."""
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((64, 3)).astype("float32"), rng.integers(-9, 9, (5, 7), dtype=np.int32),
              rng.standard_normal((9,)).astype("float16")]
    bf16 = tvm.runtime.empty((6,), "bfloat16")
    bits = rng.integers(0, 1 << 15, 6, dtype=np.uint16)
    weights.tensor_bytes(bf16)[:] = bits.view(np.uint8)
    blob = tmp_path / "w.bin"
    weights.write_blob([tvm.runtime.tensor(a) for a in arrays] + [bf16], blob)
    lib = tmp_path / "lib.bin"  # the blob at a page offset of a bigger file, as in a library
    lib.write_bytes(b"\0" * 8192 + blob.read_bytes())
    mapped = np.memmap(lib, np.uint8, mode="r")
    loaded = weights.FileWeights.of(mapped.ctypes.data + 8192)
    assert loaded is not None
    base = np.frombuffer(loaded._map, np.uint8).ctypes.data
    for a, t in zip(arrays, loaded.tensors):
        np.testing.assert_array_equal(t.numpy(), a)
        assert base <= weights.tensor_bytes(t).ctypes.data < base + len(loaded._map)  # a view, not a copy
    np.testing.assert_array_equal(weights.tensor_bytes(loaded.tensors[3]).view(np.uint16), bits)
    assert weights.FileWeights.of(ctypes.addressof(ctypes.create_string_buffer(16))) is None  # not a file's


def test_an_artefact_loaded_with_its_weights_in_the_file_computes_the_same(tiny_llama_int4):
    from qtvm.runtime import Module

    path, _ = tiny_llama_int4
    ids = {"input_ids": np.array([[1, 5, 9, 2]], np.int64)}
    copied, in_file = Module(path), Module(path, weights_in_file=True)
    assert isinstance(in_file._weights, weights.FileWeights) and isinstance(copied._weights, weights.LoadedWeights)
    for name, value in copied.run(ids).items():
        np.testing.assert_array_equal(in_file.run(ids)[name], value)
