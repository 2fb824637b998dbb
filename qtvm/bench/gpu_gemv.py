"""`qtvm bench gemv --target cuda`: qtvm's GPU decode kernels beside the GPU's HBM bandwidth
(measured in the same run with a device-to-device copy) and torch's fp16 matmul (and its
int4 kernel where this torch has one for the device), all with the weights cold in L2.

Every kernel's weights are rotated through copies totalling more than twice the L2, so
each call streams its weights from HBM (``schedules.gpu_tune.rotation_copies``); a time
is the mean over the rotation of one round, the reported value the median of the rounds.
Calls are issued from Python, so a kernel shorter than the launch path (a few us) is
timed as the launch path: the large shapes are the meaningful ones.

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


def _timed(call, sets, rounds: int, sync) -> float:
    """Median over rounds of the mean time of one call, rotating through ``sets``."""
    call(sets[0])
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for args in sets:
            call(args)
        sync()
        times.append((time.perf_counter() - start) / len(sets))
    return statistics.median(times)


def hbm_bandwidth(rounds: int, nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy (read + write bytes), the same run's reference."""
    import tvm

    dev = tvm.cuda(0)
    src = tvm.runtime.empty((nbytes // 4,), "float32", dev)
    dst = tvm.runtime.empty((nbytes // 4,), "float32", dev)
    seconds = _timed(lambda _: src.copyto(dst), [None] * 4, rounds, dev.sync)
    return 2 * nbytes / seconds / 1e9


def _qtvm_kernel(preset: str, k: int, n: int, target, activations: str, w: np.ndarray, l2: int):
    import tvm

    from qtvm import ops
    from qtvm.cuda import compile_settings
    from qtvm.formats import get_format
    from schedules import facts, schedule_kernel
    from schedules.gpu_tune import rotation_copies

    fmt, f = get_format(preset), facts(target)
    qt = ops.pad_columns(fmt.quantize(w), f.col_pad)
    if activations == "fp16" and f.f16_activations(fmt, k):
        func = ops.qmatmul_f16_func(fmt, k, qt.n, 1, **f.gemv_options(fmt, k))
    elif f.decode_kernel.get(str(fmt.describe().get("family"))) == "lut_gemv":
        from qtvm.lut_gemv import lut_gemv_func

        func = lut_gemv_func(fmt, k, qt.n, 1)
    else:
        func = ops.qmatmul_func(fmt, k, qt.n, 1, **f.gemv_options(fmt, k))
    with compile_settings(target):
        lib = tvm.compile(tvm.IRModule({"main": schedule_kernel(func, target)}), target=target)
    dev = tvm.cuda(0)
    arrays = ops.blocked_arrays(qt, 1)
    nbytes = sum(a.nbytes for a in arrays)
    sets = [[tvm.runtime.tensor(a, device=dev) for a in arrays] for _ in range(rotation_copies(nbytes, l2))]
    x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal((1, k)).astype(np.float32), device=dev)
    y = tvm.runtime.empty((1, qt.n), "float32", dev)
    main = lib["main"]
    return (lambda ws: main(x, *ws, y)), sets, nbytes, dev.sync


def _torch_peers(k: int, n: int, w: np.ndarray, l2: int):
    """(name, call, sets, bytes, sync) for torch fp16 mv and, where present, torch's int4 kernel."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    from schedules.gpu_tune import rotation_copies

    peers = []
    w16 = torch.tensor(w.T.copy(), dtype=torch.float16, device="cuda")  # [N, K]
    x16 = torch.randn(k, dtype=torch.float16, device="cuda")
    copies = [w16.clone() for _ in range(rotation_copies(w16.numel() * 2, l2))]
    peers.append(("torch fp16 mv", lambda ws: torch.mv(ws, x16), copies, w16.numel() * 2, torch.cuda.synchronize))
    if hasattr(torch, "_weight_int4pack_mm") and hasattr(torch, "_convert_weight_to_int4pack"):
        try:
            q = torch.randint(0, 16, (n, k // 2), dtype=torch.uint8, device="cuda")
            packed = torch._convert_weight_to_int4pack(q, 8)
            scales = torch.rand(k // 128, n, 2, dtype=torch.bfloat16, device="cuda")
            xb = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
            sets = [(packed.clone(), scales.clone()) for _ in range(rotation_copies(n * k // 2, l2))]
            peers.append(("torch int4 (bf16)", lambda s: torch._weight_int4pack_mm(xb, s[0], 128, s[1]), sets,
                          n * k // 2, torch.cuda.synchronize))
        except Exception:  # noqa: BLE001 -- this torch/device has no int4 kernel
            pass
    return peers


def run(shapes, formats, target_text: str, activations, rounds: int, json_path: Path | None) -> list[dict]:
    from qtvm.target import parse_target

    arch = _device()
    target = parse_target(target_text if "-arch" in target_text else f"{target_text} -arch={arch}")
    l2 = int(target.attrs["l2_cache_size_bytes"])
    bw = hbm_bandwidth(rounds)
    print(f"CUDA device {arch}; L2 {l2 >> 20} MiB (from the target); copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    for k, n in shapes:
        w = np.random.default_rng(k * n).standard_normal((k, n)).astype(np.float32) * 0.02
        entries = []
        for preset in formats:
            for act in activations:
                call, sets, nbytes, sync = _qtvm_kernel(preset, k, n, target, act, w, l2)
                entries.append((f"qtvm {preset} {act}", call, sets, nbytes, sync))
        entries += _torch_peers(k, n, w, l2)
        for name, call, sets, nbytes, sync in entries:
            seconds = _timed(call, sets, rounds, sync)
            rows.append({"shape": f"{k}x{n}", "kernel": name, "us": seconds * 1e6, "weight_bytes": nbytes,
                         "GB_s": nbytes / seconds / 1e9, "pct_bandwidth": 100 * nbytes / seconds / 1e9 / bw})
    print(f"{'shape':>12} {'kernel':<28} {'us':>9} {'GB/s':>8} {'% BW':>6}")
    for r in rows:
        print(f"{r['shape']:>12} {r['kernel']:<28} {r['us']:9.1f} {r['GB_s']:8.0f} {r['pct_bandwidth']:6.1f}")
    if json_path is not None:
        tmp = f"{json_path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"device": arch, "copy_bandwidth_GB_s": bw, "rows": rows}, f, indent=1)
        os.replace(tmp, json_path)
    return rows
