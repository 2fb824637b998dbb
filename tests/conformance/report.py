"""Run every ONNX node test through qtvm and write the conformance table (docs/onnx_conformance.md).

    python3 -m tests.conformance.report [--out docs/onnx_conformance.md] [--json out.json]

Each case as given, and (where it feeds axes/shapes/pads/k as graph inputs) again with those
inputs made initializers, the form exporters emit. The README's summary table comes from here.
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import tempfile
import time
from pathlib import Path

from tests.conformance.node_cases import ACCEPTABLE, all_cases, run_case, with_constant_parameters

FAMILIES = {
    "reductions": "ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum "
                  "ReduceLogSumExp ReduceSumSquare ArgMax ArgMin CumSum TopK",
    "normalization, softmax": "Softmax LogSoftmax Hardmax LayerNormalization InstanceNormalization "
                              "BatchNormalization GroupNormalization RMSNormalization LpNormalization "
                              "MeanVarianceNormalization LRN",
    "matmul, attention": "MatMul Gemm Einsum MatMulInteger QLinearMatMul Attention RotaryEmbedding",
    "activations": "Relu LeakyRelu PRelu Elu Selu Celu Gelu Sigmoid HardSigmoid HardSwish Tanh Softplus "
                   "Softsign Mish ThresholdedRelu Swish",
    "elementwise math": "Add Sub Mul Div Pow Sqrt Exp Log Abs Neg Reciprocal Floor Ceil Round Sign Erf Sin Cos "
                        "Tan Asin Acos Atan Sinh Cosh Asinh Acosh Atanh Mod Min Max Mean Sum Clip BitShift "
                        "BitwiseAnd BitwiseOr BitwiseXor BitwiseNot IsNaN IsInf",
    "comparison, logic": "Equal Less LessOrEqual Greater GreaterOrEqual And Or Xor Not Where",
    "shape, layout": "Reshape Transpose Concat Split Slice Squeeze Unsqueeze Expand Tile Flatten Shape Size "
                     "ConstantOfShape Range Identity Cast CastLike Pad DepthToSpace SpaceToDepth Trilu "
                     "EyeLike Constant",
    "indexing": "Gather GatherElements GatherND ScatterElements ScatterND Scatter Compress OneHot NonZero "
                "Unique",
    "convolution, pooling, resize": "Conv ConvTranspose ConvInteger MaxPool AveragePool GlobalAveragePool "
                                    "GlobalMaxPool LpPool MaxUnpool MaxRoiPool RoiAlign Resize Upsample "
                                    "GridSample AffineGrid Col2Im DeformConv CenterCropPad",
    "quantization": "QuantizeLinear DequantizeLinear DynamicQuantizeLinear QLinearConv",
}
FAMILY_OF = {op: fam for fam, ops in FAMILIES.items() for op in ops.split()}


def family(ops) -> str:
    for op in ops:
        if op in FAMILY_OF:
            return FAMILY_OF[op]
    return "other (RNN, control flow, sequences, random, ML, ...)"


def run_all(workdir) -> dict:
    out = {}
    for name, case in sorted(all_cases().items()):
        o = run_case(case, workdir)
        frozen = with_constant_parameters(case)
        f = run_case(frozen, workdir) if frozen is not None else None
        out[name] = {"ops": list(o.ops), "status": o.status, "detail": o.detail,
                     "constant_parameters": None if f is None else f.status,
                     "constant_parameters_detail": None if f is None else f.detail}
    return out


def table(results: dict) -> str:
    rows = collections.defaultdict(collections.Counter)
    ops_by_family = collections.defaultdict(set)
    passed_ops = collections.defaultdict(set)
    for r in results.values():
        fam = family(r["ops"])
        ops_by_family[fam].update(r["ops"])
        rows[fam]["cases"] += 1
        rows[fam][r["status"]] += 1
        if r["constant_parameters"] == "pass" and r["status"] != "pass":
            rows[fam]["pass with constant parameters"] += 1
        if r["status"] == "pass" or r["constant_parameters"] == "pass":
            passed_ops[fam].update(r["ops"])
    order = list(FAMILIES) + sorted(set(rows) - set(FAMILIES))
    lines = ["| family | ops with a passing test / ops tested | cases | passed | refused cleanly | "
             "refused as given, passed with constant parameters | wrong | crashed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    total = collections.Counter()
    for fam in order:
        c = rows[fam]
        total.update(c)
        lines.append(f"| {fam} | {len(passed_ops[fam])} / {len(ops_by_family[fam])} | {c['cases']} | {c['pass']} | "
                     f"{c['refused']} | {c['pass with constant parameters']} | {c['wrong']} | {c['error']} |")
    all_ops = set().union(*ops_by_family.values())
    all_passed = set().union(*passed_ops.values())
    lines.append(f"| **all** | {len(all_passed)} / {len(all_ops)} | {total['cases']} | {total['pass']} | "
                 f"{total['refused']} | {total['pass with constant parameters']} | {total['wrong']} | "
                 f"{total['error']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/onnx_conformance.md")
    p.add_argument("--json")
    args = p.parse_args(argv)
    import onnx

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_all(tmp)
    minutes = (time.time() - start) / 60
    body = table(results)
    bad = {n: r for n, r in results.items() if r["status"] not in ACCEPTABLE
           or (r["constant_parameters"] or "pass") not in ACCEPTABLE}
    refusals = collections.Counter(r["detail"].split(";")[0][:110] for r in results.values()
                                   if r["status"] == "refused")
    text = [f"# ONNX node tests through qtvm\n",
            f"onnx {onnx.__version__}, {len(results)} node tests, qtvm's pipeline (`--quant none`, exported "
            f"artefact, `qtvm.runtime`) on {platform.machine()}, {minutes:.1f} min. Regenerate with "
            "`python3 -m tests.conformance.report`; CI runs the same cases (tests/conformance).\n",
            "\"Refused cleanly\": a compile-time error naming the op, attribute or dtype. \"Refused as given, "
            "passed with constant parameters\": the test feeds axes/shape/pads/k/scales as graph inputs "
            "(qtvm needs them constant, as exporters emit them); with those inputs made initializers the "
            "case passes.\n", body, ""]
    if bad:
        text += ["## Not acceptable (wrong or crashed)\n"] + [f"- `{n}`: {r['status']} {r['detail'][:200]}"
                                                            for n, r in sorted(bad.items())] + [""]
    text += ["## Most common refusals\n"] + [f"- {c} x {msg}" for msg, c in refusals.most_common(25)] + [""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("\n".join(text))
    tmp.replace(out)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(body)
    print(f"wrote {out}; {len(bad)} wrong or crashed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
