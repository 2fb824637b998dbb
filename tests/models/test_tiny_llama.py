"""The bundled model must export cleanly and run in TVM with symbolic (batch, seq)."""

import os

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import pytest
import torch
import tvm
import tvm.relax.frontend.onnx
from tvm import relax

from qtvm.models import tiny_llama
from qtvm.models.tiny_llama import TinyLlamaConfig, build_torch_model, default_model_path, export_onnx

SHAPES = [(1, 7), (2, 32), (1, 1)]


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory):
    return export_onnx(tmp_path_factory.mktemp("tiny_llama") / "model.onnx")


@pytest.fixture(scope="module")
def onnx_model(onnx_path):
    return onnx.load(onnx_path)


@pytest.fixture(scope="module")
def torch_model():
    return build_torch_model()


@pytest.fixture(scope="module")
def tvm_vm(onnx_model):
    """Compiled once: every shape below must run through this same module."""
    mod = relax.frontend.onnx.from_onnx(onnx_model, keep_params_in_input=False)
    mod = relax.transform.DecomposeOpsForInference()(mod)
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    return relax.VirtualMachine(ex, tvm.cpu())


def _ids(batch, seq, seed=0):
    return np.random.default_rng(seed).integers(0, TinyLlamaConfig().vocab_size, (batch, seq), dtype=np.int64)


def _dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _initializers(model):
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def test_graph_io_has_symbolic_batch_and_seq(onnx_model):
    (inp,), (out,) = onnx_model.graph.input, onnx_model.graph.output
    assert inp.name == "input_ids"
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert _dims(inp) == ["batch", "seq"]
    assert out.name == "logits"
    assert out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert _dims(out) == ["batch", "seq", TinyLlamaConfig().vocab_size]
    onnx.checker.check_model(onnx_model)


def test_graph_avoids_range(onnx_model):
    """Range gets a fresh length symbol in TVM's frontend; positions must come from input_ids."""
    assert "Range" not in {n.op_type for n in onnx_model.graph.node}


def test_every_linear_weight_is_a_matmul_initializer(onnx_model, torch_model):
    inits = _initializers(onnx_model)
    consumed = []
    for node in onnx_model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            consumed.append(inits[node.input[1]])
        elif node.op_type == "Gemm" and node.input[1] in inits:
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            consumed.append(inits[node.input[1]].T if trans_b else inits[node.input[1]])
    linears = [m for m in torch_model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * TinyLlamaConfig().num_layers + 1
    assert len(consumed) == len(linears)
    for linear in linears:
        w_t = linear.weight.detach().numpy().T  # ONNX MatMul computes x @ W^T
        assert any(c.shape == w_t.shape and np.array_equal(c, w_t) for c in consumed)


def test_export_is_deterministic(tmp_path, onnx_model):
    again = _initializers(onnx.load(export_onnx(tmp_path / "again.onnx")))
    first = _initializers(onnx_model)
    assert again.keys() == first.keys()
    for name, arr in first.items():
        assert np.array_equal(arr, again[name]), name
    # The seed actually matters.
    other = build_torch_model(TinyLlamaConfig(seed=1))
    assert not torch.equal(other.lm_head.weight, build_torch_model().lm_head.weight)


def test_build_leaves_global_rng_alone():
    state = torch.get_rng_state()
    build_torch_model()
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_torch_ort_tvm_agree(batch, seq, onnx_path, torch_model, tvm_vm):
    ids = _ids(batch, seq)
    with torch.no_grad():
        ref = torch_model(torch.from_numpy(ids)).numpy()
    got_ort = ort.InferenceSession(str(onnx_path)).run(None, {"input_ids": ids})[0]
    got_tvm = tvm_vm["main"](tvm.runtime.tensor(ids)).numpy()
    assert ref.shape == got_ort.shape == got_tvm.shape == (batch, seq, TinyLlamaConfig().vocab_size)
    assert np.abs(got_ort - ref).max() < 1e-5
    assert np.abs(got_tvm - ref).max() < 1e-5
    assert np.abs(got_tvm - got_ort).max() < 1e-5


def test_outputs_are_causal_and_not_degenerate(tvm_vm):
    ids = _ids(2, 12, seed=3)
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % TinyLlamaConfig().vocab_size
    a = tvm_vm["main"](tvm.runtime.tensor(ids)).numpy()
    b = tvm_vm["main"](tvm.runtime.tensor(changed)).numpy()
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], atol=1e-6)  # the future is masked
    assert np.abs(a[:, -1] - b[:, -1]).max() > 1e-2
    assert a.std() > 0.1  # weights are scaled so logits are O(1), not ~0
    assert np.abs(a[0, 1:] - a[0, :-1]).max() > 1e-2  # positions differ


def test_default_model_path_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("QTVM_CACHE_DIR", str(tmp_path / "cache"))
    path = default_model_path()
    assert path == tmp_path / "cache" / "tiny_llama.onnx"
    assert path.is_file()
    onnx.checker.check_model(onnx.load(path))
    assert os.listdir(path.parent) == ["tiny_llama.onnx"]  # no temp files left behind

    def fail(*args, **kwargs):
        raise AssertionError("cached model must not be re-exported")

    with monkeypatch.context() as m:
        m.setattr(tiny_llama, "export_onnx", fail)
        assert default_model_path() == path

    path.unlink()
    assert default_model_path().is_file()


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("export failed")

    monkeypatch.setattr(torch.onnx, "export", boom)
    with pytest.raises(RuntimeError, match="export failed"):
        export_onnx(tmp_path / "model.onnx")
    assert os.listdir(tmp_path) == []
