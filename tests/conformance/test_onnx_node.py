"""ONNX's own node tests through qtvm's pipeline: every case passes or is refused at compile
time with a sentence naming what is unsupported. Zero wrong results, zero crashes."""
from __future__ import annotations

import pytest

from tests.conformance.node_cases import ACCEPTABLE, all_cases, run_case, with_constant_parameters

#: Ops transformer and CNN inference graphs use: each must pass at least one of its node tests
#: (a refusal of everything would satisfy "no wrong results" and be useless).
REQUIRED_OPS = (
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSumExp", "ArgMax", "ArgMin", "Softmax", "LogSoftmax", "LayerNormalization",
    "InstanceNormalization", "BatchNormalization", "MatMul", "Gemm", "Gather", "GatherElements",
    "Where", "Expand", "Reshape", "Transpose", "Concat", "Split", "Slice", "Squeeze", "Unsqueeze",
    "Cast", "Erf", "Gelu", "Tanh", "Sigmoid", "Relu", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt",
    "Range", "Shape", "ConstantOfShape", "Equal", "Less", "Greater", "Trilu", "CumSum", "Conv",
    "MaxPool", "AveragePool", "GlobalAveragePool", "Resize", "Pad", "Tile", "TopK", "Einsum", "Clip",
    "Min", "Max", "Mean", "Sum",
)


_OUTCOMES: dict = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("node_tests")


def _outcome(name, workdir, constant_parameters: bool = False):
    key = (name, constant_parameters)
    if key not in _OUTCOMES:
        case = all_cases()[name]
        if constant_parameters:
            case = with_constant_parameters(case)
        _OUTCOMES[key] = None if case is None else run_case(case, workdir)
    return _OUTCOMES[key]


def _check(outcome):
    assert outcome.status in ACCEPTABLE, f"{outcome.status}: {outcome.detail}"
    if outcome.status == "refused":  # the sentence names one of the case's ops (or its dtype)
        assert any(op.split(".")[-1] in outcome.detail for op in outcome.ops) or "tensors" in outcome.detail \
            or "values" in outcome.detail, outcome.detail


@pytest.mark.parametrize("name", sorted(all_cases()))
def test_node_case(name, workdir):
    _check(_outcome(name, workdir))


_WITH_PARAMETER_INPUTS = sorted(n for n, c in all_cases().items() if with_constant_parameters(c) is not None)


@pytest.mark.parametrize("name", _WITH_PARAMETER_INPUTS)
def test_node_case_with_constant_parameters(name, workdir):
    """The same case with its axes/shape/pads/k inputs made initializers, as exporters emit them."""
    _check(_outcome(name, workdir, constant_parameters=True))


@pytest.mark.parametrize("op", REQUIRED_OPS)
def test_required_op_passes_a_node_test(op, workdir):
    """Refusing everything would meet "no wrong results" and be useless: each op transformer
    and CNN graphs use passes at least one of its node tests, as given or with its parameter
    inputs made constants."""
    names = sorted(n for n, c in all_cases().items()
                   if any(node.op_type == op for node in c.model.graph.node) and not n.endswith("_expanded"))
    assert names, f"the onnx wheel has no node test for {op}"
    for name in names:
        for frozen in (False, True):
            outcome = _outcome(name, workdir, frozen)
            if outcome is not None and outcome.status == "pass":
                return
    pytest.fail(f"none of {len(names)} node tests of {op} passes: {_outcome(names[0], workdir).detail}")
