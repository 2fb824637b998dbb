"""The thin runtime: input checks, and no compiler library in its process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from qtvm.errors import QtvmError


@pytest.fixture(scope="module")
def module(tiny_llama_int4):
    from qtvm import runtime

    return runtime.load(tiny_llama_int4[0])


def test_signature(module):
    assert module.inputs == [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}]
    assert module.outputs == [{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", 512]}]


@pytest.mark.parametrize("feeds,needle", [
    ({"input_ids": np.zeros((1, 4), np.int32)}, "dtype int32, expected int64"),
    ({"input_ids": np.zeros((4,), np.int64)}, "rank 1"),
    ({"input_ids": np.zeros((1, 2, 3), np.int64)}, "rank 3"),
    ({"input_ids": np.zeros((1, 0), np.int64)}, "sizes must be >= 1"),
    ({}, "missing input_ids"),
    ({"input_ids": np.zeros((1, 4), np.int64), "mask": np.zeros(1)}, "unknown mask"),
])
def test_bad_inputs(module, feeds, needle):
    with pytest.raises(QtvmError, match=needle):
        module.run(feeds)


def test_out_of_range_token_ids_do_not_crash(module):
    ids = np.array([[0, 511, 512, -1, 10**9]], np.int64)
    assert module.run({"input_ids": ids})["logits"].shape == (1, 5, 512)


def test_symbolic_dims_must_agree(tmp_path):
    """Two inputs sharing 'batch' with different sizes are refused before running."""
    from qtvm.runtime import Module

    m = Module.__new__(Module)
    m.metadata = {"inputs": [{"name": "a", "dtype": "float32", "shape": ["batch", 4]},
                             {"name": "b", "dtype": "float32", "shape": ["batch"]}], "outputs": []}
    with pytest.raises(QtvmError, match="dimension 'batch' is 2 in input 'a' but 3 in input 'b'"):
        m.check_inputs({"a": np.zeros((2, 4), np.float32), "b": np.zeros(3, np.float32)})


def test_runtime_process_never_maps_compiler(tiny_llama_int4):
    script = textwrap.dedent(f"""
        import numpy as np, sys
        import qtvm.runtime as rt
        m = rt.load({str(tiny_llama_int4[0])!r})
        out = m.run({{"input_ids": np.arange(6, dtype=np.int64).reshape(2, 3)}})
        maps = open("/proc/self/maps").read()
        assert "libtvm_runtime" in maps, "runtime library not mapped?"
        import os
        assert "TVM_USE_RUNTIME_LIB" not in os.environ, "leaks into child processes"
        print("compiler mapped:", "libtvm_compiler" in maps, "libtvm.so" in maps, out["logits"].shape)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "compiler mapped: False False (2, 3, 512)" in proc.stdout


@pytest.mark.parametrize("compiler", ["qtvm.pipeline", "qtvm.explore"])
def test_the_compiler_after_the_runtime_is_refused_in_one_line(compiler):
    """A notebook that imported qtvm.runtime first holds TVM's runtime library only: importing the
    compiler then failed inside TVM ("no attribute 'RegisterOpAttr'"); it says what to do."""
    proc = subprocess.run([sys.executable, "-c", f"import qtvm.runtime; import {compiler}"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("qtvm.errors.QtvmError: this process imported qtvm.runtime before the compiler"), last
    assert "RegisterOpAttr" not in proc.stderr


def test_refuses_cpu_it_was_not_built_for(tiny_llama_int4, monkeypatch):
    from qtvm import runtime

    monkeypatch.setattr(runtime, "host_cpu_flags", lambda: {"sse2"})
    with pytest.raises(QtvmError, match="needs CPU features .*avx2"):
        runtime.load(tiny_llama_int4[0])


def _num_threads_in_child(env_threads: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    if env_threads is not None:
        env["TVM_NUM_THREADS"] = env_threads
    script = ("import os, qtvm.runtime, tvm; "
              "print(os.environ['TVM_NUM_THREADS'], tvm.get_global_func('runtime.NumThreads')())")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    var, pool = proc.stdout.split()
    return var, int(pool)


def test_kernels_run_on_every_physical_core():
    """TVM alone would start half the logical CPUs (1 of 2 on a 2-vCPU VM)."""
    from qtvm.hostinfo import physical_cores

    assert _num_threads_in_child(None) == (str(physical_cores()), physical_cores())


def test_tvm_num_threads_overrides_the_default():
    assert _num_threads_in_child("1") == ("1", 1)


def test_scalar_input_and_shape_output(tmp_path):
    """0-d inputs stay 0-d (silero-vad's `sr`), and a Shape output comes back as an int64 array."""
    import onnx
    from onnx import TensorProto, helper

    from qtvm.pipeline import compile_model  # the compiler's TVM first: qtvm.runtime would load runtime-only
    from qtvm import runtime

    nodes = [helper.make_node("Mul", ["x", "s"], ["y"]), helper.make_node("Shape", ["x"], ["shape"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
                                           helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3]),
                               helper.make_tensor_value_info("shape", TensorProto.INT64, [2])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    art = compile_model(path, tmp_path / "m.so", "host", "none").path
    module = runtime.load(art)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = module.run({"x": x, "s": np.array(2.0, np.float32)})
    np.testing.assert_array_equal(out["y"], 2 * x)
    assert out["shape"].dtype == np.int64 and out["shape"].tolist() == [2, 3]
    with pytest.raises(QtvmError, match="rank 1"):
        module.run({"x": x, "s": np.array([2.0], np.float32)})


def _checker(inputs, **meta):
    from qtvm.runtime import Module

    m = Module.__new__(Module)
    m.metadata = {"inputs": inputs, "outputs": [], **meta}
    return m


def test_dimension_expressions_limits_and_zero_lengths():
    """'past + seq' must equal past + seq; a recorded limit is enforced; only a symbol the
    compiler marked (a KV past length) may be 0."""
    m = _checker([{"name": "ids", "dtype": "int64", "shape": ["batch", "seq"]},
                  {"name": "mask", "dtype": "int64", "shape": ["batch", "past + seq"]},
                  {"name": "k", "dtype": "float32", "shape": ["batch", 2, "past", 4]}],
                 dim_limits={"seq": 8}, may_be_zero=["past"])

    def feeds(batch=1, seq=3, past=2, mask=None):
        return {"ids": np.zeros((batch, seq), np.int64), "mask": np.ones((batch, mask or past + seq), np.int64),
                "k": np.zeros((batch, 2, past, 4), np.float32)}
    assert len(m.check_inputs(feeds())) == 3
    assert len(m.check_inputs(feeds(past=0))) == 3
    with pytest.raises(QtvmError, match="input 'mask' has size 6 on axis 1, expected past \\+ seq = 5"):
        m.check_inputs(feeds(mask=6))
    with pytest.raises(QtvmError, match="this model takes seq <= 8"):
        m.check_inputs(feeds(seq=9))
    with pytest.raises(QtvmError, match="sizes must be >= 1"):
        m.check_inputs(feeds(seq=0))


def _view_model(path):
    """y = Reshape(x) (Relax makes it a view of the input), z = Relu(x)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"]), helper.make_node("Relu", ["x"], ["z"])], "views",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 2]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.array([-1, 2, 2], np.int64), "shape")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))
    return path


@pytest.mark.parametrize("batch", [3, 5000])  # staged (small) and handed over without a copy (aligned, >= 64 KB)
def test_outputs_are_arrays_of_their_own(tmp_path, batch):
    """Inputs go in without tvm.runtime.tensor's copy and outputs come out as views of the
    VM's results: no output may share memory with an input (a reshape of one) or change
    when the module runs again."""
    from qtvm import runtime
    from qtvm.pipeline import compile_model

    art = compile_model(_view_model(tmp_path / "v.onnx"), tmp_path / "v.so", "host", "none").path
    m = runtime.load(art)
    raw = np.empty(batch * 4 + 16, np.float32)
    off = (-raw.ctypes.data % 64) // 4
    x = raw[off:off + batch * 4].reshape(batch, 4)  # 64-byte aligned
    x[...] = np.random.default_rng(0).standard_normal((batch, 4))
    first = m.run({"x": x})
    kept = {k: v.copy() for k, v in first.items()}
    np.testing.assert_array_equal(first["y"], x.reshape(batch, 2, 2))
    assert not np.shares_memory(first["y"], x) and not np.shares_memory(first["y"], first["z"])
    x[...] = -1.0
    second = m.run({"x": x})
    for k, v in first.items():
        np.testing.assert_array_equal(v, kept[k])  # untouched by the later call and by the input's change
    np.testing.assert_array_equal(second["y"], np.full((batch, 2, 2), -1.0, np.float32))
    assert not second["z"].any()
    with pytest.raises(QtvmError, match="dtype float64, expected float32"):  # a validated shape, another dtype
        m.run({"x": x.astype(np.float64)})


def test_reloading_a_recompiled_path_gives_the_new_artefact(tmp_path):
    """dlopen would hand back the library first loaded from the path (a notebook that
    recompiles to the same file and loads it again); the runtime loads the new file."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from qtvm.pipeline import compile_model  # the compiler's TVM first: qtvm.runtime would load runtime-only
    from qtvm import runtime

    def model(scale: float):
        graph = helper.make_graph([helper.make_node("Mul", ["x", "c"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
                                  [numpy_helper.from_array(np.full(3, scale, np.float32), "c")])
        path = tmp_path / f"m{scale}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        return path

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    art = tmp_path / "m.so"
    first = runtime.load(compile_model(model(2.0), art, "host", "none").path)
    for scale in (3.0, 5.0):  # replaced twice: each load gets the file then at the path
        compile_model(model(scale), art, "host", "none")
        np.testing.assert_array_equal(runtime.load(art).run({"x": x})["y"], scale * x)
    np.testing.assert_array_equal(first.run({"x": x})["y"], 2 * x)  # a module already loaded keeps its code
    np.testing.assert_array_equal(runtime.load(art).run({"x": x})["y"], 5 * x)


def test_weights_are_loaded_once(tmp_path):
    """A CPU artefact's weights are a blob beside the VM's module (``qtvm.deploy.weights``):
    loading copies them once. Through the VM's constants TVM's loader held ~4x them at the peak
    (the embedded module copied, then each constant out of it) and ~2x after."""
    import onnx

    from qtvm.deploy import elf
    from qtvm.pipeline import compile_model
    from tests.conftest import matmul_model

    model, w = matmul_model(2048, 4096)  # 32 MB of float32 weights
    onnx.save(model, str(tmp_path / "mm.onnx"))
    out = compile_model(tmp_path / "mm.onnx", tmp_path / "mm.so", quant="none").path
    table = subprocess.run(["readelf", "-sW", "--dyn-syms", str(out)], capture_output=True, text=True).stdout
    sizes = {row[7]: (int(row[1], 16), int(row[2], 0)) for row in map(str.split, table.splitlines())
             if len(row) >= 8 and row[7] in ("qtvm_weights", elf.LIBRARY_BIN)}
    assert sizes["qtvm_weights"][0] % 4096 == 0
    assert sizes["qtvm_weights"][1] >= w.nbytes > 20 * sizes[elf.LIBRARY_BIN][1]  # the module: code, no weights
    script = textwrap.dedent(f"""
        import numpy as np
        import qtvm.runtime
        def hwm():
            return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
        x = np.random.default_rng(1).standard_normal((3, 2048)).astype(np.float32)
        before = hwm()
        m = qtvm.runtime.load({str(out)!r})
        y = m.run({{"x": x}})["y"]
        print(hwm() - before, float(np.abs(y - x @ np.load({str(tmp_path / 'w.npy')!r})).max()))
    """)
    np.save(tmp_path / "w.npy", w)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "QTVM_HUGEPAGES": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    grown, err = proc.stdout.split()
    assert float(err) < 1e-3
    assert int(grown) < 1.5 * w.nbytes, f"loading grew the peak by {int(grown) / w.nbytes:.2f}x the weights"
