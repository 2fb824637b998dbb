"""Every function the generic CPU rules schedule, over a corpus of graphs, equals the same
function with TVM's default loops (schedules.verify.compare): random inputs, each symbolic
dim bound to 1, 3, 64 and 67 (distinct per dim). The corpus: both bundled models (float,
int4, int4 with int8 activations), silero-vad's ONNX model, and ONNX's node tests of the ops
transformer and CNN graphs use, made symbolic (each static size becomes a dim named after
it, so sizes that must agree stay tied)."""
from __future__ import annotations

import onnx
import pytest
import tvm_ffi

from qtvm.frontend.onnx import import_onnx
from qtvm.pipeline import build_module
from qtvm.target import parse_target
from schedules.verify import compare
from schedules.x86_generic import fuse_generic_ops, generic_schedules
from tests.conformance.node_cases import all_cases, with_constant_parameters

#: Ops whose PrimFuncs take every size from their inputs' dims (no size-carrying attribute such
#: as a reshape target or a kernel), so binding the dims freely gives consistent buffers.
SYMBOLIC_OPS = {
    "Abs", "Add", "And", "ArgMax", "ArgMin", "BatchNormalization", "Cast", "Ceil", "Clip", "Concat", "Cos",
    "Div", "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid",
    "HardSwish", "Identity", "InstanceNormalization", "IsNaN", "LayerNormalization", "LeakyRelu", "Less",
    "LessOrEqual", "Log", "LogSoftmax", "MatMul", "Max", "Mean", "Min", "Mul", "Neg", "Not", "Or", "Pow",
    "PRelu", "Reciprocal", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
    "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare", "Relu", "Round", "Selu",
    "Sigmoid", "Sign", "Sin", "Softmax", "Softplus", "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh",
    "ThresholdedRelu", "Transpose", "Where", "Xor",
}


@pytest.fixture(scope="module")
def target():
    return parse_target("host")


def _scheduled_pairs(mod, target):
    fused = fuse_generic_ops(mod, target)
    return [(gv.name_hint, fused[gv], sch) for gv, sch in generic_schedules(fused, target).items() if sch is not None]


def _check(pairs, target, seen=None, domains=None) -> list[str]:
    bad = []
    for name, func, scheduled in pairs:
        if seen is not None:
            key = tvm_ffi.structural_hash(func)
            if key in seen:
                continue
            seen.add(key)
        bad += [f"{name}: {m}" for m in compare(func, scheduled, target, domains=domains)]
    return bad


@pytest.mark.parametrize("quant,act", [("none", "fp32"), ("int4-g128", "fp32"), ("int4-g128", "int8")])
def test_tiny_llama(tiny_llama_path, target, quant, act):
    mod, *_ = build_module(tiny_llama_path, target, quant, act)
    pairs = _scheduled_pairs(mod, target)
    assert len(pairs) >= 10
    assert not _check(pairs, target)


def test_minilm(target):
    from qtvm.models.minilm import default_model_path

    mod, *_ = build_module(default_model_path(), target, "none")
    pairs = _scheduled_pairs(mod, target)
    assert len(pairs) >= 5
    assert not _check(pairs, target)


def test_silero_vad(target):
    silero = pytest.importorskip("silero_vad", reason="silero-vad is installed by .ci/run")
    from pathlib import Path

    path = Path(silero.__file__).parent / "data" / "silero_vad_op18_ifless.onnx"
    mod, *_ = build_module(path, target, "none")
    pairs = _scheduled_pairs(mod, target)
    assert len(pairs) >= 5
    # Audio windows: the model reflection-pads 64 samples, so sequence must exceed 64
    # (silero's own windows are 512 samples at 16 kHz); batch takes the usual sizes.
    assert not _check(pairs, target, domains={"sequence": (512, 576, 1024, 1091)})


def _cnn_block() -> onnx.ModelProto:
    """Conv 3x3 (+bias) -> BatchNorm -> Relu -> MaxPool -> 1x1 Conv -> Sigmoid -> GlobalAveragePool ->
    Flatten -> Gemm, batch and image size symbolic: convolutions with elementwise epilogues."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def init(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)

    inits = [init("w1", 8, 3, 3, 3), init("b1", 8), init("g", 8), init("be", 8), init("mu", 8),
             numpy_helper.from_array(rng.uniform(0.5, 2, 8).astype(np.float32), "var"), init("w2", 4, 8, 1, 1),
             init("fc", 5, 4)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "g", "be", "mu", "var"], ["bn"]),
             helper.make_node("Relu", ["bn"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w2"], ["c2"]),
             helper.make_node("Sigmoid", ["c2"], ["s"]),
             helper.make_node("GlobalAveragePool", ["s"], ["gap"]),
             helper.make_node("Flatten", ["gap"], ["f"]),
             helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_cnn_block(target):
    mod = import_onnx(_cnn_block())
    pairs = _scheduled_pairs(mod, target)
    assert len(pairs) >= 3
    # Image sides of 2 and more (a 2x2 pool of a 1-pixel image is empty).
    assert not _check(pairs, target, domains={"h": (2, 3, 64, 67), "w": (3, 64, 67, 2)})


def symbolic_variant(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every input dim > 1 renamed ``n<size>`` (sizes 1 stay: broadcasting)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name for t in out.graph.initializer}
    for value in list(out.graph.input) + list(out.graph.output):
        if value.name in inits or not value.type.HasField("tensor_type"):
            continue
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value > 1:
                size = dim.dim_value
                dim.ClearField("dim_value")
                dim.dim_param = f"n{size}"
    return out


def _symbolic_node_cases():
    out = []
    for name, case in sorted(all_cases().items()):
        ops = {n.op_type for n in case.model.graph.node}
        if ops <= SYMBOLIC_OPS and not name.endswith("_expanded"):
            out.append(name)
    return out


SHARDS = 4


@pytest.mark.parametrize("shard", range(SHARDS))
def test_node_tests_made_symbolic(target, shard):
    """~400 node tests (axes/shape inputs made initializers), their distinct scheduled functions
    each checked at four bindings; in contiguous shards of the sorted names (an op's cases stay
    together, so few functions are checked twice) that test workers run side by side."""
    seen, bad, checked = set(), [], 0
    names = _symbolic_node_cases()
    for name in names[shard * len(names) // SHARDS:(shard + 1) * len(names) // SHARDS]:
        case = all_cases()[name]
        case = with_constant_parameters(case) or case  # reduction axes as initializers, as exported
        try:
            pairs = _scheduled_pairs(import_onnx(symbolic_variant(case.model)), target)
        except Exception:  # noqa: BLE001 -- refused, or needs static dims (PRelu's slope): nothing to check
            continue
        before = len(seen)
        bad += [f"{name}: {m}" for m in _check(pairs, target, seen)]
        checked += len(seen) - before
    assert checked >= 10, f"only {checked} distinct scheduled functions in shard {shard} of the symbolic node tests"
    assert not bad, "\n".join(bad[:20])
