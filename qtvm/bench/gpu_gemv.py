"""`qtvm bench gemv --target cuda`: qtvm's GPU decode kernels beside the GPU's HBM read
bandwidth (a sum over 1 GiB, measured in the same run) and torch's fp16 ``mv`` and int4 kernel,
all with the weights cold in L2.

Every kernel's weights are rotated through copies totalling more than twice the L2, so
each call streams its weights from HBM (``schedules.gpu_tune.rotation_copies``). One round
is one CUDA graph holding one call per copy (captured through torch, TVM's launches joined
to torch's stream by ``tvm_ffi.use_torch_stream``), replayed and timed with CUDA events: the
launch path stays out of the time, which matters for kernels of a few microseconds. A time
is the mean over the rotation of one round, the reported value the median of the rounds.
Without torch (or where capture fails) the calls are issued from Python and timed the same
way, and the launch path is then part of the time.

Written for a GPU machine: here (no GPU) it stops before measuring and says so.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from qtvm.errors import QtvmError


def _device():
    from qtvm.cuda import device_arch, load_cuda_runtime

    load_cuda_runtime()
    arch = device_arch()
    if arch is None:
        raise QtvmError("no CUDA device is present: `qtvm bench gemv --target cuda` measures on an NVIDIA GPU "
                        "(nothing was measured)", "run it on a machine with an NVIDIA GPU and driver")
    return arch


def _cuda_torch():
    """torch where it can run on the GPU, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def graph_time(launch, sets, rounds: int) -> float:
    """Seconds per call of ``launch(set)`` over ``sets``, median of ``rounds`` (module doc)."""

    def launch_all():
        for args in sets:
            launch(args)

    torch = _cuda_torch()
    if torch is None:
        import tvm

        dev = tvm.cuda(0)
        launch(sets[0])
        dev.sync()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            launch_all()
            dev.sync()
            times.append((time.perf_counter() - start) / len(sets))
        return statistics.median(times)
    launch(sets[0])
    torch.cuda.synchronize()
    try:
        import tvm_ffi

        graph = torch.cuda.CUDAGraph()
        with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
            launch_all()
        replay = graph.replay
    except Exception:  # noqa: BLE001 -- no capture: launches from Python, timed the same way
        torch.cuda.synchronize()
        replay = launch_all
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(sets))
    return statistics.median(times)


def reference_bandwidth(rounds: int, nbytes: int = 1 << 30) -> tuple[float, str]:
    """(GB/s, what was measured) for the same run's reference: a sum over ``nbytes`` of fp32
    through torch (each byte read once: a GEMV reads its weights and writes almost nothing);
    without a CUDA torch, a device-to-device copy through TVM, counting read and write bytes."""
    torch = _cuda_torch()
    if torch is not None:
        big = torch.rand(nbytes // 4, dtype=torch.float32, device="cuda")
        return nbytes / graph_time(lambda _: big.sum(), [None] * 4, rounds) / 1e9, "read"
    import tvm

    dev = tvm.cuda(0)
    src, dst = (tvm.runtime.empty((nbytes // 4,), "float32", dev) for _ in range(2))
    return 2 * nbytes / graph_time(lambda _: src.copyto(dst), [None] * 4, rounds) / 1e9, "copy (read + write)"


def decode_gemv_func(fmt, k: int, n: int, target, activations: str, lut: bool | None = None):
    """The unscheduled decode kernel the compiler picks for ``fmt`` on ``target`` (N already
    padded): fp16 activations where the format has that kernel (else None), BCQ's LUT-GEMM
    where the target's facts pick it (``lut`` forces the choice), else the dequantizing GEMV."""
    from qtvm import ops
    from schedules import facts

    f = facts(target)
    if activations == "fp16":
        return ops.qmatmul_f16_func(fmt, k, n, 1, **f.gemv_options(fmt, k)) if f.f16_activations(fmt, k) else None
    if lut is None:
        lut = f.decode_kernel.get(str(fmt.describe().get("family"))) == "lut_gemv"
    if lut:
        from qtvm.lut_gemv import lut_gemv_func

        return lut_gemv_func(fmt, k, n, 1)
    return ops.qmatmul_func(fmt, k, n, 1, **f.gemv_options(fmt, k))


def _qtvm_kernel(preset: str, k: int, n: int, target, activations: str, w: np.ndarray, l2: int):
    """(launch, weight sets, bytes read) of the kernel the compiler picks, or None where the
    format has none with ``activations`` (timing the fp32 kernel under an fp16 label would
    report the wrong kernel)."""
    import tvm

    from qtvm import ops
    from qtvm.cuda import compile_cuda
    from qtvm.formats import get_format
    from schedules import facts, schedule_kernel
    from schedules.gpu_tune import rotation_copies

    fmt, f = get_format(preset), facts(target)
    qt = ops.pad_columns(fmt.quantize(w), f.col_pad)
    func = decode_gemv_func(fmt, k, qt.n, target, activations)
    if func is None:  # no kernel with these activations for this format (fp16: int3, BCQ)
        return None
    lib = compile_cuda(tvm.IRModule({"main": schedule_kernel(func, target)}), target, relax_pipeline=None)
    dev = tvm.cuda(0)
    arrays = ops.blocked_arrays(qt, 1)
    nbytes = sum(a.nbytes for a in arrays)
    sets = [[tvm.runtime.tensor(a, device=dev) for a in arrays] for _ in range(rotation_copies(nbytes, l2))]
    x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal((1, k)).astype(np.float32), device=dev)
    y = tvm.runtime.empty((1, qt.n), "float32", dev)
    main = lib["main"]
    return (lambda ws: main(x, *ws, y)), sets, nbytes


def torch_peers(k: int, n: int, l2: int):
    """(name, launch, sets, bytes read) for torch's fp16 mv and, where this torch has one for
    the device, its int4 kernel (bf16 activations, group 128: scales and zeros counted)."""
    torch = _cuda_torch()
    if torch is None:
        return []
    from schedules.gpu_tune import rotation_copies

    w16 = torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02  # [N, K]
    x16 = torch.randn(k, dtype=torch.float16, device="cuda")
    peers = [("torch fp16 mv", lambda w: torch.mv(w, x16),
              [w16.clone() for _ in range(rotation_copies(w16.numel() * 2, l2))], w16.numel() * 2)]
    del w16
    try:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        packed = torch._convert_weight_to_int4pack(q, 8)
        scales = torch.rand(k // 128, n, 2, dtype=torch.bfloat16, device="cuda")
        xb = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        nbytes = n * k // 2 + scales.numel() * 2
        sets = [(packed.clone(), scales.clone()) for _ in range(rotation_copies(nbytes, l2))]
        torch._weight_int4pack_mm(xb, sets[0][0], 128, sets[0][1])
        peers.append(("torch int4 mm (bf16)", lambda s: torch._weight_int4pack_mm(xb, s[0], 128, s[1]), sets,
                      nbytes))
    except Exception:  # noqa: BLE001 -- this torch/device has no int4 kernel
        pass
    return peers


def run(shapes, formats, target_text: str, activations, rounds: int, json_path: Path | None) -> list[dict]:
    from qtvm.target import parse_target

    arch = _device()
    target = parse_target(target_text if "-arch" in target_text else f"{target_text} -arch={arch}")
    l2 = int(target.attrs["l2_cache_size_bytes"])
    bw, measured = reference_bandwidth(rounds)
    print(f"CUDA device {arch}; L2 {l2 >> 20} MiB (from the target); HBM {measured} bandwidth {bw:.0f} GB/s",
          flush=True)
    rows, skipped = [], set()
    for k, n in shapes:
        w = np.random.default_rng(k * n).standard_normal((k, n)).astype(np.float32) * 0.02
        entries = []
        for preset in formats:
            for act in activations:
                kernel = _qtvm_kernel(preset, k, n, target, act, w, l2)
                if kernel is None:
                    if (preset, act) not in skipped:
                        skipped.add((preset, act))
                        print(f"qtvm {preset}: no {act}-activation kernel for this format; not timed", flush=True)
                    continue
                entries.append((f"qtvm {preset} {act}", *kernel))
        entries += torch_peers(k, n, l2)
        for name, call, sets, nbytes in entries:
            seconds = graph_time(call, sets, rounds)
            rows.append({"shape": f"{k}x{n}", "kernel": name, "us": seconds * 1e6, "weight_bytes": nbytes,
                         "GB_s": nbytes / seconds / 1e9, "pct_bandwidth": 100 * nbytes / seconds / 1e9 / bw})
    print(f"{'shape':>12} {'kernel':<28} {'us':>9} {'GB/s':>8} {'% BW':>6}")
    for r in rows:
        print(f"{r['shape']:>12} {r['kernel']:<28} {r['us']:9.1f} {r['GB_s']:8.0f} {r['pct_bandwidth']:6.1f}")
    if json_path is not None:
        tmp = f"{json_path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"device": arch, "bandwidth_GB_s": bw, "bandwidth_measured": measured, "rows": rows}, f,
                      indent=1)
        os.replace(tmp, json_path)
    return rows
