"""Run a scheduled GPU PrimFunc on a CPU OpenCL device (PoCL), for checking numerics.

TVM's OpenCL runtime is off in the wheel, but its OpenCL code generator is not: this
module lowers the PrimFunc with TVM's own GPU pipeline for an OpenCL target (the same
passes ``tvm.compile`` runs), takes the device kernels' source, and replays the host
function itself -- its workspace allocations and kernel launches in order, with launch
extents evaluated for the symbolic dims the arrays bind -- through pyopencl. So a
schedule written for CUDA is checked for indexing, launch geometry, guards and
reductions without a GPU (not for warp shuffles: on OpenCL TVM reduces across threads
through local memory, and not for CUDA-only intrinsics such as inline PTX).

    prog = build(scheduled_func)               # OpenCL source + launch plan
    y = np.full((m, n), np.nan, np.float32)    # outputs start as NaN
    prog.run(x, *weights, y)                   # arrays in PrimFunc parameter order
    print(prog.source)

fp16: CPU OpenCL devices here lack cl_khr_fp16; ``half_as_float=True`` builds the kernel
with ``half`` spelled ``float`` and passes float16 arrays as float32 (this checks
indexing and reductions, not fp16 rounding); ``as_halfN`` (the OpenCL unpack intrinsics)
is emulated bit-exactly with ``vload_halfN``, other reinterpretations of half bits refuse.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import tirx
from tvm.target import Target

from qtvm.errors import QtvmError

OPENCL = {"kind": "opencl", "max_num_threads": 1024, "max_threads_per_block": 1024,
          "max_shared_memory_per_block": 49152}
_THREAD_DIMS = {"x": 0, "y": 1, "z": 2}
_SPLIT_PASS = "tirx.SplitHostDevice"


def opencl_target(**attrs) -> Target:
    """An OpenCL target with CUDA-like per-block limits, so a CUDA schedule builds as is."""
    return Target({**OPENCL, **attrs}).with_host(Target({"kind": "llvm"}))


@dataclass
class Launch:
    kernel: str
    args: list          # tirx expressions: buffer data vars and scalars
    params: list        # launch parameter names ("blockIdx.x", "threadIdx.x", ...)
    extents: list       # tirx expressions, one per launch parameter


@dataclass
class Program:
    """An OpenCL program and the host function's launch plan."""

    func: tirx.PrimFunc
    source: str
    host: tirx.PrimFunc
    kernel_params: dict = field(default_factory=dict)  # kernel -> [param dtypes]
    half_as_float: bool = False
    #: OpenCL build options. PoCL's optimizer is off by default: on the small shapes checks
    #: use, compiling costs far more than running (3 s instead of 8 for a GEMM kernel), and
    #: IEEE float results do not depend on it (OpenCL may contract a * b + c into an fma
    #: either way, which the checks' tolerances cover).
    options: tuple = ("-cl-opt-disable",)
    _built: dict = field(default_factory=dict, repr=False)

    def run(self, *arrays, device=None, **scalars) -> list[np.ndarray]:
        """Run with numpy ``arrays`` in the PrimFunc's parameter order (scalar parameters
        by name); every array is copied back, so outputs are updated in place."""
        import pyopencl as cl

        params = list(self.host.params)
        buffers = [p for p in params if _is_buffer(p)]
        if len(arrays) != len(buffers):
            raise QtvmError(f"the kernel takes {len(buffers)} arrays, got {len(arrays)}")
        env: dict = {p: scalars[p.name] for p in params if not _is_buffer(p)}
        for buf, a in zip(buffers, arrays):
            if len(buf.shape) != a.ndim:
                raise QtvmError(f"array for '{buf.name}' has rank {a.ndim}, the kernel's has {len(buf.shape)}")
            for dim, size in zip(buf.shape, a.shape):
                if isinstance(dim, tirx.Var) and env.setdefault(dim, size) != size:
                    raise QtvmError(f"'{dim.name}' is bound to both {env[dim]} and {size}")
        for buf, a in zip(buffers, arrays):  # composite dims (batch * seq) once every dim is bound
            if [_evaluate(d, env) for d in buf.shape] != list(a.shape):
                raise QtvmError(f"array for '{buf.name}' has shape {a.shape}, the kernel's is {list(buf.shape)}")

        ctx = device or default_context()
        queue = cl.CommandQueue(ctx)
        if ctx not in self._built:
            self._built[ctx] = cl.Program(ctx, self.source).build(options=list(self.options))
        program = self._built[ctx]
        mf = cl.mem_flags
        host_arrays = [self._device_array(a, buf) for a, buf in zip(arrays, buffers)]
        pointers = {buf: cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=h) if h.nbytes else
                    cl.Buffer(ctx, mf.READ_WRITE, 4) for buf, h in zip(buffers, host_arrays)}
        for launch in self._replay(self.host.body, env, pointers, ctx):
            kernel = cl.Kernel(program, launch.kernel)
            values = [self._arg(a, env, pointers, dtype)
                      for a, dtype in zip(launch.args, self.kernel_params[launch.kernel])]
            kernel.set_args(*values)
            grid, block = [1, 1, 1], [1, 1, 1]
            for name, extent in zip(launch.params, launch.extents):
                kind, axis = name.split(".")
                if kind == "blockIdx":
                    grid[_THREAD_DIMS[axis]] = _evaluate(extent, env)
                elif kind == "threadIdx":
                    block[_THREAD_DIMS[axis]] = _evaluate(extent, env)
                else:
                    raise QtvmError(f"launch parameter '{name}' is not supported by the OpenCL harness")
            if 0 in grid:
                continue
            cl.enqueue_nd_range_kernel(queue, kernel, [g * b for g, b in zip(grid, block)], block)
        for a, h, buf in zip(arrays, host_arrays, buffers):
            if h.nbytes:
                cl.enqueue_copy(queue, h, pointers[buf])
        queue.finish()
        for a, h in zip(arrays, host_arrays):
            if h is not a:
                a[...] = h.astype(a.dtype)
        return list(arrays)

    def _device_array(self, a: np.ndarray, buf) -> np.ndarray:
        if str(buf.dtype) != str(a.dtype):
            raise QtvmError(f"array for '{buf.name}' is {a.dtype}, the kernel's is {buf.dtype}")
        if self.half_as_float and a.dtype == np.float16:
            return np.ascontiguousarray(a, np.float32)
        return np.ascontiguousarray(a)

    def _replay(self, stmt, env, pointers, ctx):
        """The host function's statements in order; yields each kernel launch."""
        import pyopencl as cl

        if isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                yield from self._replay(s, env, pointers, ctx)
        elif isinstance(stmt, tirx.Bind):
            env[stmt.var] = _evaluate(stmt.value, env)
        elif isinstance(stmt, tirx.LetStmt):
            env[stmt.var] = _evaluate(stmt.value, env)
            yield from self._replay(stmt.body, env, pointers, ctx)
        elif isinstance(stmt, tirx.AllocBuffer):
            buf = stmt.buffer
            count = int(np.prod([_evaluate(d, env) for d in buf.shape]))
            dtype = "float32" if self.half_as_float and str(buf.dtype) == "float16" else str(buf.dtype)
            pointers[buf] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max(4, count * np.dtype(dtype).itemsize))
        elif isinstance(stmt, tirx.DeclBuffer):
            source = _buffer_of(stmt.data)
            if source is not None and source in pointers:
                pointers[stmt.buffer] = pointers[source]
        elif isinstance(stmt, tirx.AttrStmt):
            yield from self._replay(stmt.body, env, pointers, ctx)
        elif isinstance(stmt, tirx.IfThenElse):
            if _evaluate(stmt.condition, env):
                yield from self._replay(stmt.then_case, env, pointers, ctx)
            elif stmt.else_case is not None:
                yield from self._replay(stmt.else_case, env, pointers, ctx)
        elif isinstance(stmt, tirx.For):  # host loops (TVM's multi-pass scan launches kernels in one)
            start = _evaluate(stmt.min, env)
            for value in range(start, start + _evaluate(stmt.extent, env)):
                env[stmt.loop_var] = value
                yield from self._replay(stmt.body, env, pointers, ctx)
        elif isinstance(stmt, tirx.AssertStmt):
            pass  # argument checks of the packed API; the arrays were checked above
        elif isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.expr.Call) \
                and stmt.value.op.name == "tirx.call_ffi_kernel":
            call = stmt.value
            names = list(call.attrs.launch_params)
            count = len(names)
            args = list(call.args)
            yield Launch(str(args[0].value), args[1:len(args) - count], names, args[len(args) - count:])
        elif isinstance(stmt, tirx.Evaluate):
            pass
        else:
            raise QtvmError(f"the OpenCL harness cannot replay a host '{type(stmt).__name__}' statement")

    @staticmethod
    def _arg(expr, env, pointers, dtype):
        buf = _buffer_of(expr)
        if buf is not None:
            return pointers[buf]
        value = _evaluate(expr, env)
        return np.dtype(dtype).type(value)


def _buffer_of(expr):
    """The buffer Var behind a data pointer (``buffer_data(A)`` in 0.27's TIR), else None."""
    if isinstance(expr, tvm.ir.expr.Call) and getattr(expr.op, "name", "") == "tirx.buffer_data":
        return expr.args[0]
    return None


def _is_buffer(var) -> bool:
    """0.27 PrimFunc parameters are Vars; array parameters carry a BufferType."""
    return isinstance(var.ty, tvm.tirx.buffer.BufferType)


_BINARY = {
    "Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
    "FloorDiv": lambda a, b: a // b, "FloorMod": lambda a, b: a % b,
    "Div": lambda a, b: int(a / b), "Mod": lambda a, b: a - b * int(a / b),  # C semantics
    "Min": min, "Max": max, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b,
    "LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b, "GE": lambda a, b: a >= b,
    "And": lambda a, b: a and b, "Or": lambda a, b: a or b,
    "RShift": lambda a, b: a >> b, "LShift": lambda a, b: a << b, "BitwiseAnd": lambda a, b: a & b,
    "BitwiseOr": lambda a, b: a | b,
}


def _evaluate(expr, env, load=None) -> int:
    """An integer host expression (launch extents, workspace sizes) for the bound dims;
    ``load(name, index)`` reads an array element where one is needed (``qtvm.testing.traffic``)."""
    if isinstance(expr, (int, np.integer)):
        return int(expr)
    kind = type(expr).__name__
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        if expr not in env:
            raise QtvmError(f"the host expression needs '{expr.name}', which no array or scalar binds")
        return int(env[expr])
    if kind in _BINARY:
        return int(_BINARY[kind](_evaluate(expr.a, env, load), _evaluate(expr.b, env, load)))
    if kind == "Cast":
        return _evaluate(expr.value, env, load)
    if kind == "Not":
        return int(not _evaluate(expr.a, env, load))
    if kind == "Select":
        return _evaluate(expr.true_value if _evaluate(expr.condition, env, load) else expr.false_value, env, load)
    if getattr(getattr(expr, "op", None), "name", "") == "tirx.if_then_else":
        return _evaluate(expr.args[1] if _evaluate(expr.args[0], env, load) else expr.args[2], env, load)
    if load is not None and kind in ("BufferLoad", "TensorLoad"):  # 0.27 names a buffer load TensorLoad
        return int(load((expr.buffer if hasattr(expr, "buffer") else expr.source).name,
                        _evaluate(expr.indices[-1], env, load)))
    raise QtvmError(f"the OpenCL harness cannot evaluate the host expression {expr}")


@functools.lru_cache(maxsize=1)
def default_context():
    """The first OpenCL device (PoCL here), one context per process, or a clear error
    naming what to install."""
    try:
        import pyopencl as cl
    except ImportError:
        raise QtvmError("pyopencl is not installed", "pip install pyopencl (and apt-get install pocl-opencl-icd)") from None
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        platforms = []
    for platform in platforms:
        devices = platform.get_devices()
        if devices:
            return cl.Context([devices[0]])
    raise QtvmError("no OpenCL device found", "apt-get install pocl-opencl-icd (a CPU OpenCL driver)")


def available() -> bool:
    try:
        default_context()
        return True
    except QtvmError:
        return False


def lower(func: tirx.PrimFunc | tvm.IRModule, target: Target | None = None):
    """(host functions right after the host/device split, finalized device IRModule, target)."""
    target = target or opencl_target()
    if target.host is None:  # the split needs a host to put the launches on
        target = target.with_host(Target({"kind": "llvm"}))
    mod = func if isinstance(func, tvm.IRModule) else tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tirx.transform.BindTarget(target)(mod)
    # tvm.compile's own default ("default" is the s_tir pipeline for every target; 0.27's
    # get_default_tir_pipeline would pick an Adreno texture pipeline of another shape)
    pipeline, _, finalize_device = tvm.tirx.get_tir_pipeline("default")
    captured = {}

    @tvm.instrument.pass_instrument
    class _Capture:
        def run_after_pass(self, mod, info):
            if info.name == _SPLIT_PASS:
                captured["host"] = mod

    with target, tvm.transform.PassContext(instruments=[_Capture()]):
        lowered = pipeline(mod)
    from tvm.tirx.build import split_host_device_mods

    _, devices = split_host_device_mods(lowered)
    (device_target, device_mod), = devices.items()
    with target:
        device_mod = finalize_device()(device_mod)
    return captured["host"], device_mod, device_target


def build(func: tirx.PrimFunc, *, half_as_float: bool = False, target: Target | None = None) -> Program:
    """Lower a scheduled PrimFunc for OpenCL; the returned Program runs it on PoCL."""
    from tvm.tirx.build import codegen_build

    hosts, device_mod, device_target = lower(func, target)
    host = hosts["main"]
    source = codegen_build(device_mod, device_target).inspect_source()
    params = {gv.name_hint: [_param_dtype(p) for p in f.params] for gv, f in device_mod.functions.items()}
    if half_as_float:
        source = _half_as_float(source)
    return Program(func, source, host, params, half_as_float)


def _param_dtype(var) -> str:
    return "handle" if isinstance(var.ty, tvm.ir.PointerType) else str(var.ty.dtype)


#: half as float: OpenCL's ``as_halfN`` (bits -> halves, the unpack intrinsics of
#: ``qtvm.intrin.opencl``) read through ``vload_halfN``, which returns floats and needs no
#: cl_khr_fp16, so the decode's bit patterns are checked exactly.
_AS_HALF = """inline float qtvm_as_half(ushort u) { return vload_half(0, (const __private half*)&u); }
inline float2 qtvm_as_half2(uint u) { return vload_half2(0, (const __private half*)&u); }
inline float4 qtvm_as_half4(uint2 u) { return vload_half4(0, (const __private half*)&u); }
inline float8 qtvm_as_half8(uint4 u) { return vload_half8(0, (const __private half*)&u); }
"""


def _half_as_float(source: str) -> str:
    """fp16 kernels for a device without cl_khr_fp16: every half spelled float (no fp16
    rounding), ``as_halfN`` emulated bit-exactly; a kernel that reinterprets half bits any
    other way (pointer casts, as_ushort) is refused."""
    if re.search(r"\bas_ushort\d*\b|vload_half|vstore_half|\(half\d* ?\*\)", source):
        raise QtvmError("this kernel reinterprets fp16 bits; it cannot be checked with half rewritten to float")
    source = re.sub(r"#ifdef cl_khr_fp16\n.*?#endif\n", "", source, flags=re.S)  # TVM's fp16 guard
    source = re.sub(r"#pragma OPENCL EXTENSION cl_khr_fp16 : enable\n?", "", source)
    source = re.sub(r"\bconvert_half(\d*)", r"convert_float\1", source)
    emulated = re.search(r"\bas_half\d*\(", source) is not None
    source = re.sub(r"\bas_half(\d*)\(", r"qtvm_as_half\1(", source)
    source = re.sub(r"\bhalf(\d*)\b", r"float\1", source)
    return _AS_HALF + source if emulated else source

