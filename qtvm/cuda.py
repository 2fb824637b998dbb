"""CUDA artefacts on machines with or without an NVIDIA driver.

TVM's CUDA support lives in ``libtvm_runtime_cuda.so``, which links ``libcuda.so.1`` (the
driver) and ``libcudart``. Without a driver TVM cannot even *build* a CUDA module into a
loadable artefact (it keeps a source-only module), and a CUDA artefact cannot be opened.
So, only where no real ``libcuda.so.1`` can be loaded, qtvm builds a stub of it (C
functions named after the driver calls TVM links, each answering CUDA_ERROR_NO_DEVICE)
into a per-user cache and loads it first: compiling and exporting then work (nvcc makes
the device code, no driver is involved), ``qtvm inspect`` reads the artefact, and running
it says that no CUDA device is present. A real driver is never shadowed.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from qtvm.errors import QtvmError

DRIVER = "libcuda.so.1"
CUDA_ERROR_NO_DEVICE = 100
#: Driver symbols libtvm_runtime_cuda.so (TVM 0.27) imports; ``nm`` refreshes the list.
DRIVER_SYMBOLS = ("cuDeviceGetName", "cuFuncSetAttribute", "cuGetErrorName", "cuGetErrorString", "cuLaunchKernelEx",
                  "cuModuleGetFunction", "cuModuleLoadData", "cuModuleUnload", "cuTensorMapEncodeTiled")
_STUB_MESSAGE = "no CUDA driver (qtvm's libcuda stub)"
_state = {"mode": None}  # "driver" | "stub" once the CUDA runtime is loaded


def _tvm_runtime_cuda() -> Path:
    import tvm

    return Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"


def _symbols() -> list[str]:
    nm = shutil.which("nm")
    lib = _tvm_runtime_cuda()
    if nm and lib.is_file():
        out = subprocess.run([nm, "-D", "--undefined-only", str(lib)], capture_output=True, text=True).stdout
        found = sorted({line.split()[-1] for line in out.splitlines() if line.split() and line.split()[-1].startswith("cu")
                        and not line.split()[-1].startswith("cuda")})
        if found:
            return found
    return list(DRIVER_SYMBOLS)


def stub_source(symbols: list[str]) -> str:
    lines = ["/* qtvm: stand-in for the NVIDIA driver where none is installed. */",
             f'static const char *message = "CUDA_ERROR_NO_DEVICE: {_STUB_MESSAGE}";']
    for name in symbols:
        if name in ("cuGetErrorName", "cuGetErrorString"):
            lines.append(f"int {name}(int error, const char **text) {{ if (text) *text = message; return 0; }}")
        else:
            lines.append(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}")
    return "\n".join(lines) + "\n"


def stub_path() -> Path:
    """Build (once, atomically) and return the stub library in the user's cache."""
    symbols = _symbols()
    source = stub_source(symbols)
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qtvm" / f"libcuda-stub-{key}"
    path = cache / DRIVER
    if path.is_file():
        return path
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise QtvmError("building a CUDA artefact without an NVIDIA driver needs a C compiler for qtvm's driver stub",
                        "install gcc (apt-get install gcc)")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = Path(tmp) / "stub.c"
        src.write_text(source)
        out = Path(tmp) / DRIVER
        proc = subprocess.run([compiler, "-shared", "-fPIC", f"-Wl,-soname,{DRIVER}", "-o", str(out), str(src)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise QtvmError(f"could not build qtvm's CUDA driver stub: {proc.stderr.strip()[-200:]}")
        os.replace(out, path)
    return path


def driver_loadable() -> bool:
    """A real NVIDIA driver (not our stub) can be loaded in this process."""
    if _state["mode"] == "stub":
        return False
    try:
        ctypes.CDLL(DRIVER)
        return True
    except OSError:
        return False


def load_cuda_runtime(allow_stub: bool = True) -> str:
    """Load TVM's CUDA runtime (driver or stub); returns "driver" or "stub"."""
    if _state["mode"] is not None:
        return _state["mode"]
    import tvm
    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    mode = "driver" if driver_loadable() else "stub"
    if mode == "stub":
        if not allow_stub:
            raise QtvmError("no NVIDIA driver (libcuda.so.1) is installed", "run CUDA artefacts on a machine with a GPU")
        ctypes.CDLL(str(stub_path()), mode=ctypes.RTLD_GLOBAL)
    if not tvm.runtime.enabled("cuda"):
        runtime_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
        try:
            _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(package="tvm", target_name="tvm_runtime_cuda",
                                                              extra_lib_paths=[runtime_dir], mode="RTLD_LOCAL")
        except (OSError, FileNotFoundError, RuntimeError) as e:
            raise QtvmError(f"TVM's CUDA runtime does not load ({str(e).splitlines()[0][:200]})",
                            "install the CUDA toolkit's runtime (libcudart.so.13)") from None
    _state["mode"] = mode
    return mode


def sm_number(arch: str) -> int:
    """The compute capability of an ``sm_XX`` name as a number (``sm_90a`` -> 90, ``sm_100`` ->
    100); -1 for anything else."""
    digits = arch[3:].rstrip("a") if arch.startswith("sm_") else ""
    return int(digits) if digits.isdigit() else -1


def device_arch(index: int = 0) -> str | None:
    """``sm_XX`` of CUDA device ``index``, or None when there is none (or no driver)."""
    import tvm

    if _state["mode"] != "driver":
        return None
    dev = tvm.cuda(index)
    try:
        if not dev.exist:
            return None
        return "sm_" + str(dev.compute_version).replace(".", "")
    except Exception:  # noqa: BLE001 -- a driver without a usable device
        return None


def nvcc_available() -> bool:
    from qtvm.testing.ptxas import nvcc_path

    return nvcc_path() is not None


#: ptxas' own default register-usage level. TVM asks for 10, at which ptxas 13.0 gives up on
#: some kernels ("C7600 Register allocation failed with register count of '7'", seen on the
#: LUT-GEMM GEMV at K = 256..512 on sm_80 and sm_90); the same source compiles at 5.
PTXAS_FALLBACK_REG_LEVEL = "5"


@contextlib.contextmanager
def compile_settings(target, ptxas_reg_level: str | None = None):
    """What TVM needs to build CUDA device code into a loadable module: nvcc (TVM's default,
    NVRTC, needs the cuda-bindings package), no fast math, the runtime (driver or stub)
    loaded so the device code is embedded instead of left as source, the target current.
    ``ptxas_reg_level`` overrides TVM's ptxas register-usage level (``compile_cuda``)."""
    if not nvcc_available():
        raise QtvmError("compiling for CUDA needs nvcc", "install the CUDA toolkit (nvcc 12 or 13) or set CUDA_HOME")
    load_cuda_runtime()
    settings = {"TVM_CUDA_COMPILE_MODE": os.environ.get("TVM_CUDA_COMPILE_MODE") or "nvcc",
                # TVM passes --use_fast_math unless told not to: approximate exp/div/sqrt and
                # flushed denormals are a numerics change qtvm does not make by default.
                "TVM_CUDA_NVCC_NO_FAST_MATH": "1"}
    if ptxas_reg_level is not None:
        settings["TVM_CUDA_PTXAS_REG_LEVEL"] = ptxas_reg_level
    previous = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        with target:  # TVM's nvcc callback reads the arch from the current target
            yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def compile_cuda(mod, target, relax_pipeline="default"):
    """``tvm.compile`` for a CUDA target under ``compile_settings``; where ptxas fails at TVM's
    register-usage level (``PTXAS_FALLBACK_REG_LEVEL``), the module is built again at ptxas'
    default level, unless the user chose a level (TVM_CUDA_PTXAS_REG_LEVEL)."""
    import tvm

    kwargs = {} if relax_pipeline is None else {"relax_pipeline": relax_pipeline}
    try:
        with compile_settings(target):
            return tvm.compile(mod, target=target, **kwargs)
    except Exception as e:  # noqa: BLE001 -- only ptxas' register-allocation failure is retried
        if "C7600" not in str(e) or os.environ.get("TVM_CUDA_PTXAS_REG_LEVEL"):
            raise
    with compile_settings(target, ptxas_reg_level=PTXAS_FALLBACK_REG_LEVEL):
        return tvm.compile(mod, target=target, **kwargs)
