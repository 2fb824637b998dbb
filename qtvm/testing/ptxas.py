"""CUDA without a GPU: TVM's CUDA source of a scheduled kernel, compiled by nvcc and
checked by ptxas for an architecture (registers, shared memory, local-memory spills).

    src = cuda_source(scheduled_func, target)          # the code TVM would embed
    for k in ptxas_check(src, "sm_90"):                # one entry per __global__ kernel
        assert k.spill_bytes == 0 and k.stack_bytes == 0

Nothing here executes CUDA; numerics are checked by running the same scheduled TIR on
OpenCL (``qtvm.testing.opencl``).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import tvm

from qtvm.errors import QtvmError


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel on one architecture."""

    name: str
    arch: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


def nvcc_path() -> str | None:
    for candidate in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def available() -> bool:
    return nvcc_path() is not None


def cuda_source(func: tvm.tirx.PrimFunc | tvm.IRModule, target: tvm.target.Target) -> str:
    """TVM's CUDA source for a scheduled PrimFunc (or module of them), without nvcc."""
    from tvm.tirx.build import codegen_build

    from qtvm.testing.opencl import lower

    _, device_mod, device_target = lower(func, target)
    if not tvm.runtime.enabled("cuda"):  # TVM keeps a source-only module
        return codegen_build(device_mod, device_target).inspect_source()
    # With TVM's CUDA runtime loaded (a driver, or qtvm's stub) the code generator also
    # compiles; hand it a compiler that does nothing, since only the source is wanted.
    import tvm_ffi

    compile_callback = "tvm_callback_cuda_compile"
    original = tvm.get_global_func(compile_callback, allow_missing=True)
    tvm_ffi.register_global_func(compile_callback, lambda code: bytearray(b"qtvm: source only"), override=True)
    try:
        return codegen_build(device_mod, device_target).inspect_source()
    finally:
        if original is not None:
            tvm_ffi.register_global_func(compile_callback, original, override=True)


def nvcc_flags() -> list[str]:
    """The flags TVM's nvcc path compiles artefacts with (``tvm.support.nvcc``), minus fast
    math, which qtvm turns off (``qtvm.cuda.compile_cuda``): ptxas' register budget depends
    on them, so spills are checked under the same ones."""
    try:
        from tvm.support.nvcc import _ptxas_option_flags

        ptxas_flags = list(_ptxas_option_flags())
    except ImportError:  # a TVM without the helper: its 0.27 defaults
        ptxas_flags = ["-v", "--register-usage-level=10", "--warn-on-local-memory-usage"]
    if "-v" not in ptxas_flags:
        ptxas_flags.append("-v")
    return ["-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "--expt-relaxed-constexpr",
            f"--ptxas-options={','.join(ptxas_flags)}"]


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(.*)")
_SMEM = re.compile(r"(\d+) bytes smem")


def ptxas_check(source: str, arch: str, timeout: float = 300) -> list[KernelResources]:
    """nvcc -cubin -arch=<arch> (TVM's flags, ptxas -v) on the source; one KernelResources per kernel."""
    return ptxas_check_archs({arch: source}, timeout)[arch]


def ptxas_check_archs(sources: dict[str, str], timeout: float = 300) -> dict[str, list[KernelResources]]:
    """``ptxas_check`` of each arch's source, the nvcc processes running side by side (nvcc's
    front end takes most of the time and one process uses one core)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise QtvmError("nvcc is not installed", "install the CUDA toolkit (nvcc, ptxas) or set CUDA_HOME")
    with tempfile.TemporaryDirectory(prefix="qtvm-ptxas-") as tmp:
        procs = {}
        for arch, source in sources.items():
            src = os.path.join(tmp, f"kernels_{arch}.cu")
            with open(src, "w") as f:
                f.write(source)
            procs[arch] = subprocess.Popen([nvcc, "-cubin", f"-arch={arch}", *nvcc_flags(), "-o",
                                            os.path.join(tmp, f"{arch}.cubin"), src],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outputs = {}
        try:
            for arch, proc in procs.items():
                stdout, stderr = proc.communicate(timeout=timeout)
                outputs[arch] = (proc.returncode, stdout, stderr)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    results = {}
    for arch, (returncode, stdout, stderr) in outputs.items():
        if returncode != 0:
            lines = stderr.splitlines()
            first = next((line for line in lines if " error" in line or "fatal" in line), stderr.strip()[-300:])
            raise QtvmError(f"nvcc could not compile the CUDA source for {arch}: {first}")
        results[arch] = parse_ptxas(stderr + stdout)
    return results


def parse_ptxas(text: str) -> list[KernelResources]:
    out, current, frame = [], None, (0, 0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current, frame = (m.group(1), m.group(2)), (0, 0, 0)
        elif (m := _FRAME.search(line)) and current:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and current:
            smem = _SMEM.search(m.group(2))
            out.append(KernelResources(current[0], current[1], int(m.group(1)), int(smem.group(1)) if smem else 0,
                                       *frame))
            current = None
    return out
