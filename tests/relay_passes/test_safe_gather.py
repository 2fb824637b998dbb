from __future__ import annotations

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from qtvm.frontend.onnx import import_onnx
from relay_passes.safe_gather import safe_gather


def test_gather_becomes_wrap_and_keeps_valid_results():
    table = np.arange(20, dtype=np.float32).reshape(5, 4)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["out"], axis=0)], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 4])],
        [numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    mod = safe_gather(import_onnx(model))
    assert 'mode="wrap"' in mod.script() and 'mode="fast"' not in mod.script()
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(np.array([0, 4, -1, 7, 10**6], np.int64))).numpy()
    np.testing.assert_array_equal(out[:3], table[[0, 4, -1]])  # valid ids (incl. negative) are exact
    assert out.shape == (5, 4)  # invalid ids: a wrapped row, not a crash
