"""Shared by the kernel tests: compile a scheduled kernel, run it on column-blocked weights."""
from __future__ import annotations

import numpy as np
import tvm

from qtvm import ops
from qtvm.hostinfo import host_cpu_flags
from schedules import compile_kernel

NB = 64  # column block of the x86 rules
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})  # runs on every supported x86 host
# One target per byte-dot ISA of the int8-activation kernels (and the AVX-512 VNNI one with
# GFNI's 2/3-bit unpack: alderlake has GFNI too, on ymm); RUNNABLE: those this host executes.
ISA_TARGETS = {"avx2": AVX2,
               "avxvnni": tvm.target.Target({"kind": "llvm", "mcpu": "alderlake"}),  # AVX-VNNI + GFNI, no AVX-512
               "avx512bw": tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"}),
               "avx512vnni": tvm.target.Target({"kind": "llvm", "mcpu": "cascadelake"}),
               "avx512vnni_gfni": tvm.target.Target({"kind": "llvm", "mcpu": "icelake-server"})}
ISA_FLAGS = {"avx2": {"avx2"}, "avxvnni": {"avx2", "avx_vnni", "gfni"}, "avx512bw": {"avx512bw"},
             "avx512vnni": {"avx512bw", "avx512_vnni"}, "avx512vnni_gfni": {"avx512bw", "avx512_vnni", "gfni"}}
RUNNABLE = [isa for isa, flags in ISA_FLAGS.items() if flags <= host_cpu_flags()]


def compile_scheduled(func: tvm.tirx.PrimFunc, target: tvm.target.Target):
    """The PrimFunc scheduled by the first matching rule, compiled."""
    return compile_kernel(func, target)


def run_blocked(lib, x: np.ndarray, qt, nb: int = NB) -> np.ndarray:
    """lib(x, *blocked weights of qt, y) -> y; y starts as NaN so unwritten outputs fail checks."""
    out = tvm.runtime.tensor(np.full((x.shape[0], qt.n), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(np.ascontiguousarray(x, np.float32)),
                *[tvm.runtime.tensor(a) for a in ops.blocked_arrays(qt, nb)], out)
    return out.numpy()


def rel_err(got, want) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def int8_rounded_reference(x, fmt, qt):
    """x rounded exactly as the activation kernel does (per 32 values, symmetric int8)."""
    kp = fmt.padded_k(qt.k)
    xp = np.zeros((x.shape[0], kp))
    xp[:, : qt.k] = x
    blocks = xp.reshape(x.shape[0], -1, ops.ACT_BLOCK)
    scale = np.abs(blocks).max(-1, keepdims=True).astype(np.float32) / np.float32(127)
    safe = np.where(scale > 0, scale, 1)
    xq = np.clip(np.round(blocks / safe), -127, 127) * scale
    return xq.reshape(x.shape[0], kp)[:, : qt.k] @ qt.dequantize().astype(np.float64)


def a8_inputs(target, fmt, qt, x, row_tile=None) -> list:
    """The int8 kernels' arguments but y: for the GEMV (``row_tile`` None) x itself (it
    rounds x inside); for the prefill kernel x quantized by the scheduled
    quantize_activations kernel (rows padded to ``row_tile``); then the weights in the a8 layout."""
    weights = [tvm.runtime.tensor(a) for a in ops.a8_arrays(qt, NB)]
    if row_tile is None:
        return [tvm.runtime.tensor(np.ascontiguousarray(x, np.float32))] + weights
    quant = compile_scheduled(ops.quantize_activations_func(fmt, qt.k, row_tile), target)
    kp, groups = fmt.padded_k(qt.k), fmt.padded_k(qt.k) // fmt.group_size_for(qt.k)
    mp = -(-x.shape[0] // row_tile) * row_tile
    acts = [tvm.runtime.tensor(np.full(s, 99, d)) for s, d in  # padding rows must be written too
            (((mp, kp), np.int8), ((mp, kp // 32), np.float32), ((mp, groups), np.float32))]
    quant["main"](tvm.runtime.tensor(x), *acts)
    return acts + weights


def run_a8(target, fmt, qt, x, row_tile=None, lib=None):
    """The GEMV (row_tile None: x rounded inside) or quantize_activations + the row-tiled
    prefill kernel (or ``lib``, a compiled kernel of the same kind)."""
    if lib is None:
        lib = compile_scheduled(ops.qmatmul_a8_func(fmt, qt.k, qt.n, NB) if row_tile is None
                                else ops.qmatmul_a8_gemm_func(fmt, qt.k, qt.n, NB, row_tile), target)
    y = tvm.runtime.tensor(np.full((x.shape[0], qt.n), np.nan, np.float32))
    lib["main"](*a8_inputs(target, fmt, qt, x, row_tile), y)
    return y.numpy(), lib
