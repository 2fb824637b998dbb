"""benchmarks/gpu_device_check.py's parts that run without a GPU: the kernel specs it records,
the per-layer dispatch modules (built for the CPU here, as the check builds its references),
and the VM call trace (on a CPU artefact: every packed matmul's input and output, in order)."""
from __future__ import annotations

import numpy as np
import tvm

from benchmarks import gpu_device_check as check


def test_param_specs_name_symbolic_rows_and_weight_bytes():
    from qtvm import ops
    from qtvm.formats import get_format

    func = ops.qmatmul_func(get_format("int4-g128"), 256, 64, 1)
    specs = check._param_specs(func)
    assert specs[0] == {"name": "x", "shape": ["m", 256], "dtype": "float32"}
    assert specs[-1]["shape"] == ["m", 64]
    # 4 bits a weight, fp32 scale and zero per 128 rows and column
    assert sum(check._nbytes(s) for s in specs[1:-1]) == 256 * 64 // 2 + 2 * (2 * 64 * 4)


def test_layer_dispatches_compute_what_the_model_run_did(tiny_llama_path, tiny_llama_int4):
    """Each layer's dispatch on its own (the check's CPU reference), fed the input the same
    layer got inside a model run (traced through the VM's instrument hook), gives its output."""
    from qtvm.pipeline import build_module
    from qtvm.target import parse_target

    host = parse_target("host")
    mod, *_ = build_module(tiny_llama_path, host, "int4-g128", "fp32")
    vm = tvm.runtime.vm.VirtualMachine(check._layer_module(mod, host), tvm.cpu())
    calls = check.trace_model(tiny_llama_int4[0], np.array([[5, 6, 7]], np.int64), tvm.cpu())
    traced = {key.split("_", 1)[1][:-2]: key[:-2] for key in calls if "dispatch" in key and key.endswith("/x")}
    assert len(traced) == 9  # 2 layers x (q/k/v, o, gate/up, down) + the LM head: shared inputs run as one
    for name, key in traced.items():
        got = vm[name](tvm.runtime.tensor(calls[key + "/x"])).numpy()
        np.testing.assert_allclose(got, calls[key + "/y"], rtol=1e-5, atol=1e-6)


def test_trace_records_every_packed_matmul_in_order(tiny_llama_int4):
    path, _ = tiny_llama_int4
    ids = np.array([[1, 2, 3]], np.int64)
    calls = check.trace_model(path, ids, tvm.cpu())
    kernels = sorted(k for k in calls if k.endswith("/y") and "dispatch" not in k)
    # 2 layers x 7 projections + the LM head, q/k/v and gate/up each one kernel (combine_matmuls)
    assert len(kernels) == 9 == sum(row["count"] for row in tiny_llama_int4[1].metadata["layers"])
    assert calls["logits"].shape == (1, 3, 512)
    last = calls[kernels[-1]]
    np.testing.assert_array_equal(last.reshape(-1), calls["logits"].reshape(-1))  # the LM head's output
