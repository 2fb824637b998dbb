"""Shared fixtures: small ONNX models, one compiled tiny LLaMA per session, and transformers
exports (compiled once per session, for every directory's tests)."""
from __future__ import annotations

import os
import pathlib

import numpy as np
import onnx
import pytest
# The compiler's TVM, before any test imports qtvm.runtime (which would otherwise load the
# runtime-only library and leave this process unable to compile). Runtime-only behaviour is
# tested in subprocesses.
import tvm  # noqa: F401
from onnx import TensorProto, helper, numpy_helper


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    from qtvm.models.tiny_llama import export_onnx

    return export_onnx(tmp_path_factory.mktemp("model") / "tiny_llama.onnx")


@pytest.fixture(scope="session")
def tiny_llama_int4(tiny_llama_path, tmp_path_factory):
    """(artefact path, CompileResult) for int4-g128 on the host."""
    from qtvm.pipeline import compile_model

    result = compile_model(tiny_llama_path, tmp_path_factory.mktemp("art") / "tiny_int4.so", "host", "int4-g128")
    return result.path, result


# Tuning measures kernels against each other: the tuning test modules share one xdist worker
# (``pytestmark = TUNING_WORKER``), so two of them never time kernels side by side
# (.ci/run: -n 2 --dist loadgroup).
TUNING_WORKER = pytest.mark.xdist_group("tuning")


def matmul_model(k: int, n: int, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    """(x[batch, k] @ w -> y[batch, n]: one MatMul on a constant weight, w)."""
    w = (np.random.default_rng(seed).standard_normal((k, n)) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), w


def save_with_external_data(model: onnx.ModelProto, path, pads: dict[str, int] | None = None) -> None:
    """``model`` saved with every initializer in ``path``.data: each after ``pads[name]`` bytes
    of padding (unaligned offsets: a writer that packs tensors back to back), or by default
    each at a multiple of 64 bytes (as torch.onnx's exporters write them)."""
    from onnx.external_data_helper import set_external_data

    model = onnx.ModelProto.FromString(model.SerializeToString())
    with open(f"{path}.data", "wb") as f:
        for t in model.graph.initializer:
            if not t.HasField("raw_data"):
                continue
            f.write(b"\0" * (pads.get(t.name, 0) if pads is not None else -f.tell() % 64))
            set_external_data(t, f"{pathlib.Path(path).name}.data", offset=f.tell(), length=len(t.raw_data))
            f.write(t.raw_data)
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
    onnx.save(model, str(path))


def moe_model(k: int = 200, n: int = 70, experts: int = 3, seed: int = 0, dtype: int = TensorProto.FLOAT):
    """Two routed matmuls as transformers' batched experts export them: Gather(W0[E, N, K], ids)
    @ x[s, K, 1] (the legacy exporter), then y0[s, 1, N] @ GatherND(W1[E, N, K], ids[s, 1])
    (the dynamo exporter's gather, W1 stored [K, N] per expert); rows s symbolic. ``dtype``:
    of x, y and the weights (TensorProto.FLOAT16 / BFLOAT16: a half precision export)."""
    rng = np.random.default_rng(seed)
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    w0 = numpy_helper.from_array(rng.standard_normal((experts, n, k)).astype(np_type), "w0")
    w1 = numpy_helper.from_array(rng.standard_normal((experts, n, k)).astype(np_type), "w1")
    axes = [numpy_helper.from_array(np.array([a], np.int64), f"axis{a}") for a in (1, 2)]
    nodes = [helper.make_node("Gather", ["w0", "ids"], ["g0"], axis=0),
             helper.make_node("Unsqueeze", ["x", "axis2"], ["x3"]),
             helper.make_node("MatMul", ["g0", "x3"], ["p0"]), helper.make_node("Squeeze", ["p0", "axis2"], ["y0"]),
             helper.make_node("Unsqueeze", ["ids", "axis1"], ["ids2"]),
             helper.make_node("GatherND", ["w1", "ids2"], ["g1"]),
             helper.make_node("Unsqueeze", ["y0", "axis1"], ["y03"]),
             helper.make_node("MatMul", ["y03", "g1"], ["p1"]), helper.make_node("Squeeze", ["p1", "axis1"], ["y"])]
    graph = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", dtype, ["s", k]),
                                             helper.make_tensor_value_info("ids", TensorProto.INT64, ["s"])],
                              [helper.make_tensor_value_info("y", dtype, ["s", k])], [w0, w1, *axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def mlp_model(k: int = 100, hidden: int = 70, n: int = 37, seed: int = 0) -> onnx.ModelProto:
    """x[batch, k] -> Gemm(transB=1, bias) -> Relu -> MatMul -> y; plus x @ x^T-style computed matmul."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((hidden, k)).astype(np.float32) * 0.1  # Gemm B with transB=1: [N, K]
    b1 = rng.standard_normal(hidden).astype(np.float32) * 0.1
    w2 = rng.standard_normal((hidden, n)).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["hr"], name="relu"),
        helper.make_node("MatMul", ["hr", "w2"], ["y"], name="fc2"),
        helper.make_node("Transpose", ["x"], ["xt"], name="xt"),
        helper.make_node("MatMul", ["x", "xt"], ["gram"], name="gram"),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n]),
         helper.make_tensor_value_info("gram", TensorProto.FLOAT, ["batch", "batch"])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def mlp_path(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), str(path))
    return path


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    """Where exports go: QTVM_TEST_EXPORTS (kept between sessions) or a session temp dir."""
    kept = os.environ.get("QTVM_TEST_EXPORTS")
    return pathlib.Path(kept) if kept else tmp_path_factory.mktemp("hf_exports")


@pytest.fixture(scope="session")
def hf_model(hf_dir, tmp_path_factory):
    """hf_model(family, exporter, kv=False) -> ONNX path, exported once per run: pytest-xdist's
    workers share one directory (``cached_export`` locks each file), so a family is exported once,
    not once a worker (60-odd exports of 5-7 s)."""
    from tests.frontend.transformers_exports import cached_export

    directory = hf_dir if os.environ.get("QTVM_TEST_EXPORTS") else \
        _run_shared_dir(tmp_path_factory, "hf_exports_shared") or hf_dir
    return lambda family, exporter, kv=False, mask=True: cached_export(directory, family, exporter, kv, mask)


def _run_shared_dir(tmp_path_factory, name: str) -> pathlib.Path | None:
    """A directory every pytest-xdist worker of this run sees (beside the workers' own), or None
    when the run has one process."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    directory = tmp_path_factory.getbasetemp().parent / name
    directory.mkdir(exist_ok=True)
    return directory


@pytest.fixture(scope="session")
def hf_compiled(hf_model, tmp_path_factory):
    """hf_compiled(family, exporter, quant, kv=False, kv_cache="model") -> CompileResult, compiled
    once per run: the workers share the artefacts (one compiles under a lock, the others load its
    result), as they share the exports. KV exports are compiled for generation at batch <= 2 (the
    KV step's memory plan)."""
    import fcntl
    import pickle

    from qtvm.pipeline import compile_model

    done = {}
    out_dir = _run_shared_dir(tmp_path_factory, "hf_artefacts_shared") or tmp_path_factory.mktemp("hf_artefacts")

    def get(family, exporter, quant, kv=False, kv_cache="model"):
        key = (family, exporter, quant, kv, kv_cache)
        if key not in done:
            stem = out_dir / "_".join(map(str, key))
            with open(f"{stem}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                saved = pathlib.Path(f"{stem}.result")
                if saved.exists():
                    done[key] = pickle.loads(saved.read_bytes())
                else:
                    done[key] = compile_model(hf_model(family, exporter, kv), f"{stem}.so", "host", quant,
                                              max_batch=2 if kv else 1, kv_cache=kv_cache)
                    saved.write_bytes(pickle.dumps(done[key]))
        return done[key]
    return get
