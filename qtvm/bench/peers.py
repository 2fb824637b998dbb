"""Peer GEMV implementations to compare our kernels against -- at their best.

Every peer is set up the way a user who wants speed would set it up, never a
strawman:

* :func:`torch_fp32_mv` -- ``torch.mv`` on a contiguous ``[N, K]`` fp32 weight
  (the layout ``nn.Linear`` keeps, so the BLAS gemv reads it row-contiguous),
  into a preallocated output.
* :func:`torch_int4` -- torch's CPU int4 weight-only kernel,
  ``aten._weight_int4pack_mm_for_cpu``, with bf16 activations, weights packed
  once by ``aten._convert_weight_to_int4pack_for_cpu``.
* :func:`ort_matmulnbits` -- onnxruntime's ``com.microsoft.MatMulNBits``
  (bits=4) with ``accuracy_level=4`` (int8 activations, MLAS's fastest CPU
  path), prepacked at session creation, run through io_binding with input and
  output bound once.

Conventions (verified numerically against the kernels, see tests/bench):

torch int4 (torch 2.13, CPU)
    ``_convert_weight_to_int4pack_for_cpu(q, innerKTiles)`` takes ``q`` as an
    **int32 [N, K]** tensor of values 0..15 (one per element, not pre-packed)
    and returns uint8 ``[N, K/2]`` in its own blocked layout (for N a multiple
    of 64: ``[N/64][K][32]`` bytes, byte j holding row n0+j in the low nibble
    and row n0+32+j in the high nibble). ``innerKTiles`` does not change the
    CPU result. ``qScaleAndZeros`` is **[K/g, N, 2]** in the activation dtype,
    ``[..., 0]`` = scale, ``[..., 1]`` = zero, and the kernel dequantizes
    ``w = (q - 8) * scale + zero``. So an asymmetric min/max quantizer stores
    ``zero = min + 8 * scale``. Requirements: N % 16 == 0, K % g == 0,
    g in {32, 64, 128, 256}.

ORT MatMulNBits (bits=4)
    ``B``: uint8 ``[N, n_blocks, block_size/2]``, n_blocks = ceil(K /
    block_size); element k of column n sits in byte k//2 of its block, even k
    in the low nibble, odd k in the high nibble; K is zero-padded to whole
    blocks. ``scales``: float32 ``[N * n_blocks]`` (column-major over blocks,
    i.e. ``scales[n * n_blocks + b]``). ``zero_points``: uint8
    ``[N * ceil(n_blocks / 2)]``, two 4-bit zero points per byte, even block
    in the low nibble, each column padded to a whole byte. Dequantization:
    ``w = (q - zp) * scale``. With ``accuracy_level=4`` MLAS quantizes the
    activations to int8 per ``block_size`` run of K with scale
    ``max|x| / 127`` and round-half-to-even; :meth:`Peer.reference` models
    that, so it matches ORT to ~1e-6 relative.

Each peer is a :class:`Peer`: callable on ``x`` (fp32 ``[K]`` or ``[1, K]``),
with ``weight_bytes`` (packed bytes + scales/zeros streamed per call),
``reference(x)`` (float64, from the dequantized weights it actually holds),
``set_input``/``run`` for timing without conversions in the loop, and
``copy()`` for building DRAM-rotation copies with their own memory.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "Peer",
    "torch_fp32_mv",
    "torch_int4",
    "quantize_int4_torch",
    "ort_matmulnbits",
    "pack_matmulnbits",
    "build_matmulnbits_model",
    "ort_activation_int8",
    "PEER_FACTORIES",
    "benchmark_peers",
]


def _as_row(x: np.ndarray, K: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.shape[0] != K:
        raise ValueError(f"x has {x.shape[0]} elements, expected K={K}")
    return x


class Peer:
    """A GEMV ``y[N] = x[K] @ W[K, N]`` implementation to benchmark.

    Subclasses implement ``_set_input``, ``run``, ``_output``, ``reference``
    and ``copy``.
    """

    name: str = "peer"
    fmt: str = ""
    K: int
    N: int
    weight_bytes: int
    threads: int | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.set_input(x)
        self.run()
        return self.output()

    def set_input(self, x: np.ndarray) -> None:
        """Convert and keep ``x`` in the peer's native form (untimed)."""
        self._set_input(_as_row(x, self.K))

    def _set_input(self, x: np.ndarray) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self) -> None:
        """Compute on the stored input; the timed hot path."""
        raise NotImplementedError

    def output(self) -> np.ndarray:
        """Last result as float32 numpy ``[N]``."""
        return np.asarray(self._output(), dtype=np.float32).reshape(-1)

    def _output(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def reference(self, x: np.ndarray) -> np.ndarray:
        """float64 ``[N]`` result from the dequantized weights the peer holds."""
        raise NotImplementedError

    def copy(self) -> "Peer":
        """An equivalent peer with its own weight memory (for DRAM rotation)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} K={self.K} N={self.N} {self.weight_bytes} B>"


def _check_w(W: np.ndarray) -> np.ndarray:
    W = np.asarray(W)
    if W.ndim != 2:
        raise ValueError(f"W must be [K, N], got shape {W.shape}")
    return W.astype(np.float32, copy=False)


# --------------------------------------------------------------------------
# torch fp32
# --------------------------------------------------------------------------


class _TorchFp32(Peer):
    def __init__(self, W: np.ndarray, op: str = "mv"):
        import torch

        self._torch = torch
        self._W = W
        self.K, self.N = W.shape
        if op not in ("mv", "linear"):
            raise ValueError("op must be 'mv' or 'linear'")
        self.op = op
        self.name = "torch_fp32_mv" if op == "mv" else "torch_fp32_linear"
        self.fmt = "fp32"
        # [N, K] contiguous: what nn.Linear stores and gemv reads row by row.
        self.w = torch.from_numpy(np.ascontiguousarray(W.T))
        self.weight_bytes = self.w.numel() * self.w.element_size()
        self._x = torch.zeros(self.K, dtype=torch.float32)
        self._x2 = self._x.view(1, self.K)
        self._y = torch.empty(self.N, dtype=torch.float32)
        self._y2 = self._y.view(1, self.N)

    def _set_input(self, x: np.ndarray) -> None:
        self._x.copy_(self._torch.from_numpy(x))

    def run(self) -> None:
        with self._torch.inference_mode():
            if self.op == "mv":
                self._torch.mv(self.w, self._x, out=self._y)
            else:
                self._y2.copy_(self._torch.nn.functional.linear(self._x2, self.w))

    def _output(self) -> np.ndarray:
        return self._y.numpy()

    def reference(self, x: np.ndarray) -> np.ndarray:
        return _as_row(x, self.K).astype(np.float64) @ self._W.astype(np.float64)

    def copy(self) -> "_TorchFp32":
        return _TorchFp32(self._W, self.op)


def torch_fp32_mv(W: np.ndarray, *, op: str = "mv") -> Peer:
    """fp32 GEMV with ``torch.mv`` on a contiguous [N, K] copy of ``W`` [K, N].

    ``op="linear"`` uses ``F.linear(x[1, K], w)`` instead (same BLAS path with
    an allocation per call; mv into a preallocated output is the faster one).
    """
    return _TorchFp32(_check_w(W), op)


# --------------------------------------------------------------------------
# torch int4
# --------------------------------------------------------------------------


_TORCH_INT4_GROUPS = (32, 64, 128, 256)


def quantize_int4_torch(W: np.ndarray, group_size: int, act_dtype: Any = None):
    """Asymmetric round-to-nearest int4 of ``W`` [K, N], groups along K.

    Returns ``(q_int32[N, K], scales_and_zeros[K/g, N, 2], w_deq[K, N] float64)``
    in torch's convention ``w = (q - 8) * scale + zero`` with
    ``zero = min + 8 * scale``; scale and zero are rounded to ``act_dtype``
    (bf16 by default) *before* the reference is formed, so ``w_deq`` is what
    the kernel holds.
    """
    import torch

    act_dtype = torch.bfloat16 if act_dtype is None else act_dtype
    W = _check_w(W)
    K, N = W.shape
    if group_size not in _TORCH_INT4_GROUPS:
        raise ValueError(f"torch int4 group_size must be one of {_TORCH_INT4_GROUPS}, got {group_size}")
    if K % group_size:
        raise ValueError(f"torch int4 needs K % group_size == 0 (K={K}, group_size={group_size})")
    if N % 16:
        raise ValueError(f"torch's CPU int4 packing needs N % 16 == 0 (N={N})")
    G = K // group_size
    w = torch.from_numpy(np.ascontiguousarray(W.T)).reshape(N, G, group_size)  # [N, G, g]
    mn = w.amin(-1)
    mx = w.amax(-1)
    scale = ((mx - mn) / 15).clamp(min=1e-6)
    q = torch.round((w - mn[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    zero = mn + 8 * scale
    s_a = scale.to(act_dtype)
    z_a = zero.to(act_dtype)
    sz = torch.stack([s_a, z_a], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
    deq = (q.double() - 8) * s_a.double()[..., None] + z_a.double()[..., None]  # [N, G, g]
    return q.reshape(N, K).contiguous(), sz, deq.reshape(N, K).numpy().T


class _TorchInt4(Peer):
    def __init__(self, q: Any, sz: Any, deq: np.ndarray, group_size: int, act_dtype: Any, inner_k_tiles: int):
        import torch

        self._torch = torch
        self._q, self._sz, self._deq = q, sz, deq
        self.N, self.K = q.shape
        self.group_size = group_size
        self.act_dtype = act_dtype
        self.inner_k_tiles = inner_k_tiles
        self.name = f"torch_int4_g{group_size}"
        self.fmt = f"int4_g{group_size}" + ("" if act_dtype == torch.bfloat16 else f"_{str(act_dtype).split('.')[-1]}")
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)
        self.scales_zeros = sz.clone()
        self.weight_bytes = (
            self.packed.numel() * self.packed.element_size()
            + self.scales_zeros.numel() * self.scales_zeros.element_size()
        )
        self._x = torch.zeros(1, self.K, dtype=act_dtype)
        self._y = None

    def _set_input(self, x: np.ndarray) -> None:
        self._x.copy_(self._torch.from_numpy(x).view(1, self.K))

    def run(self) -> None:
        self._y = self._torch.ops.aten._weight_int4pack_mm_for_cpu(
            self._x, self.packed, self.group_size, self.scales_zeros
        )

    def _output(self) -> np.ndarray:
        if self._y is None:
            raise RuntimeError("run() first")
        return self._y.float().numpy()

    def activation(self, x: np.ndarray) -> np.ndarray:
        """x as the kernel sees it (rounded to the activation dtype), float64."""
        t = self._torch.from_numpy(_as_row(x, self.K)).to(self.act_dtype)
        return t.double().numpy()

    def reference(self, x: np.ndarray) -> np.ndarray:
        return self.activation(x) @ self._deq

    def copy(self) -> "_TorchInt4":
        return _TorchInt4(self._q, self._sz, self._deq, self.group_size, self.act_dtype, self.inner_k_tiles)


def torch_int4(W: np.ndarray, group_size: int = 128, *, act_dtype: Any = None, inner_k_tiles: int = 2) -> Peer:
    """torch CPU int4 weight-only GEMV (``_weight_int4pack_mm_for_cpu``).

    ``W`` is [K, N] float; quantized asymmetric RTN, groups of ``group_size``
    along K. Activations bf16 by default (``act_dtype=torch.float32`` also
    works). The output is in the activation dtype (bf16: ~3 significant
    digits), so compare to :meth:`reference` with a relative 2^-8 tolerance.
    """
    import torch

    act_dtype = torch.bfloat16 if act_dtype is None else act_dtype
    q, sz, deq = quantize_int4_torch(W, group_size, act_dtype)
    return _TorchInt4(q, sz, deq, group_size, act_dtype, inner_k_tiles)


# --------------------------------------------------------------------------
# onnxruntime MatMulNBits
# --------------------------------------------------------------------------


def pack_matmulnbits(W: np.ndarray, block_size: int):
    """Quantize ``W`` [K, N] to 4 bits in MatMulNBits' layout.

    Asymmetric RTN per block of ``block_size`` along K, range widened to
    include 0 (``scale = (max(w_max, 0) - min(w_min, 0)) / 15``, ``zp =
    round(-min / scale)``, ``q = clip(round(w / scale) + zp, 0, 15)``).
    Returns ``(B uint8[N, n_blocks, block_size/2], scales f32[N*n_blocks],
    zero_points uint8[N*ceil(n_blocks/2)], w_deq f64[K, N])``.
    """
    W = _check_w(W)
    K, N = W.shape
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    nb = -(-K // block_size)
    Kp = nb * block_size
    valid = (np.arange(Kp) < K).reshape(nb, block_size)
    Wt = np.zeros((N, Kp), np.float32)
    Wt[:, :K] = W.T
    blk = Wt.reshape(N, nb, block_size)
    bmin = np.where(valid[None], blk, np.inf).min(-1)
    bmax = np.where(valid[None], blk, -np.inf).max(-1)
    rmin = np.minimum(bmin, 0.0)
    rmax = np.maximum(bmax, 0.0)
    scale = ((rmax - rmin) / 15.0).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    zp = np.clip(np.round(-rmin / scale), 0, 15).astype(np.uint8)
    q = np.clip(np.round(blk / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
    B = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    zpp = np.zeros((N, nb + (nb & 1)), np.uint8)
    zpp[:, :nb] = zp
    zpk = (zpp[:, 0::2] | (zpp[:, 1::2] << 4)).astype(np.uint8)
    deq = (q.astype(np.float64) - zp[..., None]) * scale.astype(np.float64)[..., None]
    deq = deq.reshape(N, Kp)[:, :K].T
    return np.ascontiguousarray(B), scale.reshape(-1), zpk.reshape(-1), np.ascontiguousarray(deq)


def build_matmulnbits_model(
    K: int, N: int, block_size: int, B: np.ndarray, scales: np.ndarray, zero_points: np.ndarray,
    accuracy_level: int = 4, rows: int | str = 1,
) -> bytes:
    """Serialized one-node ONNX model: y[rows, N] = MatMulNBits(x[rows, K], B, scales, zp).

    ``rows`` > 1, or a symbolic name such as "M", is the prefill form (``qtvm bench
    prefill``); GEMV keeps 1.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node(
        "MatMulNBits",
        ["x", "B", "scales", "zero_points"],
        ["y"],
        domain="com.microsoft",
        K=int(K),
        N=int(N),
        bits=4,
        block_size=int(block_size),
        accuracy_level=int(accuracy_level),
    )
    graph = helper.make_graph(
        [node],
        "qtvm_matmulnbits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, N])],
        initializer=[
            numpy_helper.from_array(B, "B"),
            numpy_helper.from_array(scales, "scales"),
            numpy_helper.from_array(zero_points, "zero_points"),
        ],
    )
    # IR version 9 / opset 17: loadable by every onnxruntime >= 1.16 (newer
    # onnx defaults to an IR version older runtimes reject).
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=9,
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def ort_activation_int8(x: np.ndarray, block_size: int) -> np.ndarray:
    """x as MatMulNBits with accuracy_level=4 sees it: int8 per block of K.

    Per run of ``block_size`` values: scale = max|x| / 127 (float32), q =
    round-half-even(x / scale), value = q * scale. Returns float64 [K].
    """
    x = np.asarray(x, np.float32).reshape(-1)
    K = x.shape[0]
    nb = -(-K // block_size)
    xp = np.zeros(nb * block_size, np.float32)
    xp[:K] = x
    b = xp.reshape(nb, block_size)
    amax = np.abs(b).max(-1, keepdims=True)
    sc = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(sc > 0, sc, np.float32(1))
    q = np.round(b / safe)  # float32 division, like the kernel
    return (q.astype(np.float64) * sc.astype(np.float64)).reshape(-1)[:K]


_ORT_SHARED_POOL: int | None = None


def _ensure_shared_pool(threads: int) -> None:
    """Size onnxruntime's process-wide thread pool (before the first session)."""
    global _ORT_SHARED_POOL
    if _ORT_SHARED_POOL is None:
        from onnxruntime.capi import _pybind_state as C

        C.set_global_thread_pool_sizes(int(threads), 1)
        _ORT_SHARED_POOL = int(threads)
    elif _ORT_SHARED_POOL != threads:
        raise RuntimeError(
            f"onnxruntime's global pool is already sized {_ORT_SHARED_POOL}; it cannot change in "
            f"this process (run other thread counts in a fresh process)"
        )


class _OrtMatMulNBits(Peer):
    def __init__(
        self,
        packed: tuple,
        K: int,
        N: int,
        block_size: int,
        accuracy_level: int,
        threads: int,
        shared_pool: bool,
        use_io_binding: bool,
    ):
        import onnxruntime as ort

        self._ort = ort
        self._packed = packed
        B, scales, zps, deq, model = packed
        self._deq = deq
        self.K, self.N = K, N
        self.block_size = block_size
        self.accuracy_level = accuracy_level
        self.threads = threads
        self.shared_pool = shared_pool
        self.use_io_binding = use_io_binding
        self.name = f"ort_matmulnbits_b{block_size}"
        self.fmt = f"int4_b{block_size}_acc{accuracy_level}"
        self.weight_bytes = B.nbytes + scales.nbytes + zps.nbytes

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        if shared_pool:
            _ensure_shared_pool(threads)
            so.use_per_session_threads = False
        else:
            so.intra_op_num_threads = int(threads)
            so.inter_op_num_threads = 1
        self.sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        self._x = np.zeros((1, K), np.float32)
        self._y = np.zeros((1, N), np.float32)
        if use_io_binding:
            self._xv = ort.OrtValue.ortvalue_from_numpy(self._x)
            self._yv = ort.OrtValue.ortvalue_from_numpy(self._y)
            self._binding = self.sess.io_binding()
            self._binding.bind_ortvalue_input("x", self._xv)
            self._binding.bind_ortvalue_output("y", self._yv)
        self._ro = ort.RunOptions()

    def _set_input(self, x: np.ndarray) -> None:
        self._x[0, :] = x  # same memory the bound OrtValue points at

    def run(self) -> None:
        if self.use_io_binding:
            self.sess.run_with_iobinding(self._binding, self._ro)
        else:
            self._y[...] = self.sess.run(None, {"x": self._x}, self._ro)[0]

    def _output(self) -> np.ndarray:
        if self.use_io_binding:
            return self._yv.numpy()
        return self._y

    def activation(self, x: np.ndarray) -> np.ndarray:
        x = _as_row(x, self.K)
        if self.accuracy_level == 4:
            return ort_activation_int8(x, self.block_size)
        return x.astype(np.float64)

    def reference(self, x: np.ndarray) -> np.ndarray:
        """Dequantized weights times x as the op sees it (int8-rounded at level 4)."""
        return self.activation(x) @ self._deq

    def reference_fp(self, x: np.ndarray) -> np.ndarray:
        """Dequantized weights times the unrounded fp32 x."""
        return _as_row(x, self.K).astype(np.float64) @ self._deq

    def copy(self) -> "_OrtMatMulNBits":
        return _OrtMatMulNBits(
            self._packed, self.K, self.N, self.block_size, self.accuracy_level,
            self.threads, self.shared_pool, self.use_io_binding,
        )


def _default_threads() -> int:
    env = os.environ.get("QTVM_BENCH_THREADS")
    if env:
        return int(env)
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:  # pragma: no cover
        return os.cpu_count() or 1


def ort_matmulnbits(
    W: np.ndarray,
    block_size: int = 128,
    accuracy_level: int = 4,
    *,
    threads: int | None = None,
    shared_pool: bool = False,
    use_io_binding: bool = True,
) -> Peer:
    """onnxruntime ``com.microsoft.MatMulNBits`` (bits=4) GEMV on ``x[1, K]`` fp32.

    ``threads`` sets ``intra_op_num_threads`` (default: ``$QTVM_BENCH_THREADS``
    or torch's thread count). With ``shared_pool=True`` all sessions in the
    process share one global pool of ``threads`` threads (sized once per
    process) -- what a model with many MatMulNBits nodes in one session gets,
    and the fair setting when rotating many one-node sessions: otherwise each
    session keeps its own pool, whose idle workers spin on the cores the next
    session needs.
    """
    W = _check_w(W)
    K, N = W.shape
    B, scales, zps, deq = pack_matmulnbits(W, block_size)
    model = build_matmulnbits_model(K, N, block_size, B, scales, zps, accuracy_level)
    t = _default_threads() if threads is None else int(threads)
    return _OrtMatMulNBits((B, scales, zps, deq, model), K, N, block_size, accuracy_level, t,
                           shared_pool, use_io_binding)


PEER_FACTORIES: dict[str, Callable[..., Peer]] = {
    "torch_fp32": lambda W, threads, **kw: torch_fp32_mv(W, **kw),
    "torch_int4": lambda W, threads, group_size=128, **kw: torch_int4(W, group_size, **kw),
    "ort_matmulnbits": lambda W, threads, block_size=128, **kw: ort_matmulnbits(
        W, block_size, threads=threads, **kw
    ),
}


# --------------------------------------------------------------------------
# benchmark entry (run one thread count per process)
# --------------------------------------------------------------------------


def benchmark_peers(
    shapes: Sequence[Sequence[int]],
    threads: int,
    peers: Sequence[str] = ("torch_fp32", "torch_int4", "ort_matmulnbits"),
    *,
    group_size: int = 128,
    ort_shared_pool: bool = True,
    min_total_bytes: int | None = None,
    rounds: int = 3,
    max_rounds: int = 12,
    reference_bw: float | None = None,
    min_probe_ratio: float = 0.8,
    quiet_wait_s: float = 0.0,
    min_iters: int = 60,
    iters_per_copy: int = 2,
    warmup: int = 5,
    probe_bytes: int | None = None,
    l3_bytes: int | None = None,
    seed: int = 0,
    check: bool = True,
    peer_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    hot_iters: int = 200,
    gap_s: float | None = None,
) -> dict:
    """Time each peer on each (K, N) shape with DRAM rotation, ``threads`` threads.

    Meant to run in a fresh process per thread count
    (``harness.run_in_subprocess("qtvm.bench.peers:benchmark_peers", {...},
    env=harness.thread_env(n))``). ``shapes`` are (K, N). Returns
    ``{"results": [BenchResult dicts], "bandwidth_probes": {...}}``.

    For each shape all peers' rotation copies are built first, then timed in
    ``rounds`` interleaved rounds (peer A, B, C, then B, C, A, ...: ``harness.turn_order``); each
    turn first calls every copy once, untimed, so it is timed as it streams its weights in a
    steady loop, as a decode step does, not on the first pass after another runtime's (on the
    Intel Xeon VM a turn warmed by 5 calls ran int4 at 1093 us median, spread 871-1348, and
    MatMulNBits at 1283; warmed over every copy 756 us, 712-792, and 1032: 6 alternations). Each round
    is bracketed by short read-bandwidth probes at the same thread count. On a
    shared (virtualised) host the bandwidth -- and at 2 threads even whether
    the two vCPUs run in parallel -- changes over seconds; interleaving
    spreads that over all peers instead of charging it to whichever ran last,
    and a round whose probes fall below ``min_probe_ratio`` x the best
    bandwidth seen (``reference_bw`` or probed) is rejected and re-run, up to
    ``max_rounds`` attempts (if none is accepted, all are used and the results
    are marked ``unstable``). Each result's extras hold the per-round
    medians, the accepted probes, the rejected ones, ``pct_of_probe_bw``
    (GB/s over the median accepted probe), and ``hot_gbps``: the same call
    repeated ``hot_iters`` times on one copy (weights cache-resident: the
    kernel's compute ceiling; from the 10th percentile of the single-call
    times, as other processes only ever add time), and for a peer with its own
    timer loop (``kernel_seconds``: qtvm's kernels) ``kernel_hot_gbps``, the same
    without a Python call per run (which, at a 10 us kernel, is a third of the time).
    Every peer's output is checked against its reference before timing when
    ``check`` is set. ``l3_bytes`` overrides the L3 size used for rotation
    (tests only: a smaller value no longer guarantees DRAM reads).
    With ``quiet_wait_s`` > 0 each round first waits (up to that long) for
    the machine's CPUs to be idle, so other processes' work is not charged
    to the peers; the busy fraction seen is recorded per round.
    Before each peer's turn and each probe the process idles ``gap_s`` (default
    ``harness.POOL_WIND_DOWN_S``), so no runtime's spinning pool is charged to the next.
    """
    from qtvm.bench import bandwidth, harness

    if gap_s is None:
        gap_s = harness.POOL_WIND_DOWN_S
    rng = np.random.default_rng(seed)
    results = []
    probes_by_shape: dict[str, list[float]] = {}
    peer_kwargs = dict(peer_kwargs or {})
    if probe_bytes is None:
        probe_bytes = bandwidth.default_buffer_bytes()
    from qtvm import hugepages

    probe = bandwidth.BandwidthProbe(probe_bytes, huge_pages=hugepages.enabled())  # the weights' pages
    with harness.threads(threads):
        for K, N in shapes:
            K, N = int(K), int(N)
            W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
            x = rng.standard_normal(K).astype(np.float32)
            bases: list[Peer] = []
            rot: list[list[Peer]] = []
            pool_flags: list[Any] = []
            for pname in peers:
                kw = dict(peer_kwargs.get(pname, {}))
                if pname == "torch_int4":
                    kw.setdefault("group_size", group_size)
                elif pname == "ort_matmulnbits":
                    kw.setdefault("block_size", group_size)
                    kw.setdefault("shared_pool", ort_shared_pool)
                base = PEER_FACTORIES[pname](W, threads, **kw)
                if check:
                    y = base(x)
                    ref = base.reference(x)
                    err = float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30))
                    if not err < 2e-2:
                        raise AssertionError(f"{base.name} disagrees with its reference: rel err {err:.3g}")
                copies = harness.rotating_copies(
                    lambda i, b=base: b if i == 0 else b.copy(), base.weight_bytes, min_total_bytes, l3_bytes=l3_bytes
                )
                for c in copies:
                    c.set_input(x)
                bases.append(base)
                rot.append(copies)
                pool_flags.append(kw.get("shared_pool") if pname == "ort_matmulnbits" else None)
            if quiet_wait_s > 0:
                harness.wait_for_quiet(quiet_wait_s)
            ref_bw = max(reference_bw or 0.0, probe.measure(threads, repeats=3, streams=(1, 2, 4)))
            busy_seen: list[float] = []
            times: list[list[float]] = [[] for _ in bases]
            round_meds: list[list[float]] = [[] for _ in bases]
            round_turns: list[list[int]] = [[] for _ in bases]  # each reported round's turn (0: after the probe)
            bw_probes: list[float] = []
            rejected: list[list[float]] = []
            accepted = attempts = 0
            pending: list[tuple[list[list[float]], list[int], float, float]] = []

            def keep(got: list[list[float]], order: list[int], before: float, after: float) -> None:
                for j, t in enumerate(got):
                    times[j] += t
                    round_meds[j].append(harness.median(t) * 1e6)
                    round_turns[j].append(order.index(j))
                bw_probes.extend((before, after))

            while accepted < rounds and attempts < max(rounds, max_rounds):
                attempts += 1
                if quiet_wait_s > 0:
                    busy_seen.append(harness.wait_for_quiet(quiet_wait_s)[0])
                time.sleep(gap_s)
                before = probe.measure(threads, repeats=2, streams=(1, 2, 4))
                got: list[list[float]] = [[] for _ in rot]
                order = harness.turn_order(len(rot), attempts - 1)
                for j in order:
                    copies = rot[j]
                    time.sleep(gap_s)
                    total_iters = max(min_iters, iters_per_copy * len(copies))
                    per_round = -(-total_iters // rounds)
                    got[j] = harness.time_rotating(
                        lambda p: p.run(), copies, warmup=warmup, iters=per_round, touch_all=True
                    )
                time.sleep(gap_s)
                after = probe.measure(threads, repeats=2, streams=(1, 2, 4))
                ref_bw = max(ref_bw, before, after)
                pending.append((got, order, before, after))
                if min(before, after) >= min_probe_ratio * ref_bw:
                    accepted += 1
                    keep(got, order, before, after)
                else:
                    rejected.append([before, after])
            unstable = accepted == 0
            if unstable:  # never a quiet round: report everything, flagged
                for attempt in pending:
                    keep(*attempt)
            bw_med = harness.median(bw_probes)
            probes_by_shape[f"{K}x{N}"] = bw_probes
            hot, kernel_hot = [], []
            for base in bases:
                time.sleep(gap_s)
                hot.append(_hot_seconds(base, hot_iters))
                kernel_hot.append(_kernel_hot_seconds(base, hot_iters))
            for j, base in enumerate(bases):
                extras: dict[str, Any] = {
                    "n_copies": len(rot[j]),
                    "rotated_bytes": len(rot[j]) * base.weight_bytes,
                    "round_median_us": round_meds[j],
                    "round_turn": round_turns[j],
                    "bw_probe_gbps": bw_probes,
                    "bw_reference_gbps": ref_bw,
                    "rejected_round_probes": rejected,
                    "accepted_rounds": accepted,
                    "cpu_busy_before_rounds": busy_seen,
                    "unstable": unstable,
                }
                if pool_flags[j] is not None:
                    extras["ort_shared_pool"] = pool_flags[j]
                if hot[j] is not None:
                    extras["hot_us"] = hot[j] * 1e6
                    extras["hot_gbps"] = base.weight_bytes / hot[j] / 1e9
                if kernel_hot[j] is not None:
                    extras["kernel_hot_us"] = kernel_hot[j] * 1e6
                    extras["kernel_hot_gbps"] = base.weight_bytes / kernel_hot[j] / 1e9
                r_ = harness.BenchResult.from_times(
                    base.name, (N, K), base.fmt, threads, times[j], base.weight_bytes, **extras
                )
                r_.extras["pct_of_probe_bw"] = 100.0 * r_.gbps / bw_med
                results.append(r_.to_dict())
            del rot, bases, copies, base
            gc.collect()
    return {"results": results, "bandwidth_probes": probes_by_shape}


def _kernel_hot_seconds(peer: Peer, iters: int) -> float | None:
    """Cache-hot seconds from the peer's own timer loop (``kernel_seconds``: qtvm's kernels
    under TVM's time_evaluator), None where it has none or iters < 1."""
    timer = getattr(peer, "kernel_seconds", None)
    return None if timer is None or iters < 1 else timer(iters)


def _hot_seconds(peer: Peer, iters: int) -> float | None:
    """10th percentile of ``iters`` single calls on one copy (cache-hot); None if iters < 1."""
    if iters < 1:
        return None
    for _ in range(min(iters, 10)):  # warm the caches and the thread pool
        peer.run()
    clock, times = time.perf_counter_ns, []
    for _ in range(iters):
        t0 = clock()
        peer.run()
        times.append((clock() - t0) * 1e-9)
    times.sort()
    return times[len(times) // 10]
