"""Which compiler links an artefact, from the host part of the target.

TVM generates the machine code itself (LLVM for the CPU part, OpenCL/CUDA source for
a device part); a C/C++ compiler only links the objects into a shared library.  For
the build machine's own triple that is TVM's default (``g++``); for any other triple
it must be a cross compiler for that triple, or the library is unusable on the device:

* ``aarch64-linux-gnu`` (ARM boards, Linux phones): Debian's ``g++-aarch64-linux-gnu``
  (``aarch64-linux-gnu-g++``), or ``--cross-cc`` / ``QTVM_CROSS_CC``;
* ``aarch64-linux-android[API]``: the Android NDK's
  ``aarch64-linux-android<API>-clang++``, found under ``ANDROID_NDK_HOME`` (or
  ``ANDROID_NDK_ROOT``), or named by ``TVM_NDK_CC`` (TVM's own variable) or
  ``--cross-cc``.  The NDK is not a Debian package.

The compiler is resolved before any compile work, so a missing one is a one-line error
and nothing is written.  ``-device=mali`` / ``-device=adreno`` OpenCL targets without a
host default to an aarch64 Linux host (the device is on an ARM board or phone).
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from qtvm.errors import QtvmError

#: ELF machine names as ``readelf -h`` prints them, per triple architecture.
ELF_MACHINES = {"aarch64": "AArch64", "arm64": "AArch64", "x86_64": "Advanced Micro Devices X86-64",
                "armv7": "ARM", "armv7a": "ARM", "arm": "ARM", "riscv64": "RISC-V"}
#: Debian package with the cross C++ compiler, per Linux triple architecture.
DEBIAN_CROSS_PACKAGES = {"aarch64": "g++-aarch64-linux-gnu", "armv7": "g++-arm-linux-gnueabihf",
                         "arm": "g++-arm-linux-gnueabihf", "riscv64": "g++-riscv64-linux-gnu"}
_GNU_PREFIX = {"aarch64": "aarch64-linux-gnu", "armv7": "arm-linux-gnueabihf", "arm": "arm-linux-gnueabihf",
               "riscv64": "riscv64-linux-gnu"}
PHONE_GPUS = ("mali", "adreno")
DEFAULT_PHONE_HOST = {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}
NDK_ENV = ("ANDROID_NDK_HOME", "ANDROID_NDK_ROOT", "ANDROID_NDK")
NDK_BIN = "toolchains/llvm/prebuilt/linux-x86_64/bin"
CROSS_CC_ENV = "QTVM_CROSS_CC"


@dataclass(frozen=True)
class Toolchain:
    """A cross compiler that links shared libraries for ``triple``."""

    triple: str  # as the target spells it
    cc: str  # compiler path
    system: str  # "linux" | "android"
    arch: str  # first component of the triple

    @property
    def elf_machine(self) -> str:
        return ELF_MACHINES.get(self.arch, self.arch)

    def dumpmachine(self) -> str:
        proc = subprocess.run([self.cc, "-dumpmachine"], capture_output=True, text=True, timeout=60)
        return proc.stdout.strip()

    def fcompile(self):
        """The ``fcompile`` for ``export_library``: link with this compiler; the object
        that carries the embedded modules is generated for the compiler's own triple."""
        from tvm.support import cc

        machine = self.dumpmachine() or self.triple
        options = ["-lm"] if self.system == "android" else []
        return cc.cross_compiler(self.cc, options=options, output_format="so", get_target_triple=lambda: machine)

    def describe(self) -> str:
        return f"{self.cc} ({self.triple})"


def _arch(triple: str) -> str:
    arch = triple.split("-", 1)[0].lower()
    return "aarch64" if arch == "arm64" else arch


def build_arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def host_target(target):
    """The part of ``target`` that runs on the CPU: the target itself for llvm/c, else its host."""
    return target if target.kind.name in ("llvm", "c") else target.host


def host_triple(target) -> str:
    host = host_target(target)
    if host is None:
        return ""
    return str(host.attrs.get("mtriple", "") or "")


def is_phone_gpu(target) -> bool:
    keys = {str(k) for k in target.keys}
    return target.kind.name == "opencl" and bool(keys & set(PHONE_GPUS))


def with_default_host(target):
    """(target, note): a Mali/Adreno OpenCL target without a host gets an aarch64 Linux host."""
    import tvm

    if not is_phone_gpu(target) or target.host is not None:
        return target, None
    device = next(k for k in PHONE_GPUS if k in {str(k) for k in target.keys})
    target = tvm.target.Target(target, host=tvm.target.Target(DEFAULT_PHONE_HOST))
    return target, (f"host: {DEFAULT_PHONE_HOST['mtriple']} (a {device.title()} GPU sits on an ARM board or phone; "
                    "for Android give --host 'llvm -mtriple=aarch64-linux-android')")


def _executable(path: str) -> str | None:
    found = shutil.which(path)
    return found if found and os.access(found, os.X_OK) else None


def _check_named(cc: str, triple: str, source: str) -> str:
    found = _executable(cc)
    if found is None:
        raise QtvmError(f"{source} names '{cc}', which is not an executable compiler",
                        f"point it at a C++ compiler for {triple}")
    return found


def _ndk_compiler(triple: str) -> str | None:
    api = re.search(r"android(\d+)$", triple)
    for var in NDK_ENV:
        root = os.environ.get(var)
        if not root:
            continue
        bindir = Path(root) / NDK_BIN
        arch = _arch(triple)
        if api:
            cands = [bindir / f"{arch}-linux-android{api.group(1)}-clang++"]
        else:  # the newest API level the NDK ships
            cands = sorted(bindir.glob(f"{arch}-linux-android[0-9]*-clang++"),
                           key=lambda p: int(re.search(r"android(\d+)-", p.name).group(1)), reverse=True)
        for cand in cands:
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return None


def _android(triple: str, cross_cc: str | None) -> Toolchain:
    arch = _arch(triple)
    named = cross_cc or os.environ.get(CROSS_CC_ENV) or os.environ.get("TVM_NDK_CC")
    if named:
        source = "--cross-cc" if cross_cc else (CROSS_CC_ENV if os.environ.get(CROSS_CC_ENV) else "TVM_NDK_CC")
        return Toolchain(triple, _check_named(named, triple, source), "android", arch)
    found = _ndk_compiler(triple)
    if found is None:
        looked = ", ".join(f"{v}={os.environ[v]}" for v in NDK_ENV if os.environ.get(v)) or "ANDROID_NDK_HOME unset"
        raise QtvmError(
            f"no Android NDK compiler for {triple} found ({looked})",
            f"install the Android NDK (r23 or newer) and set ANDROID_NDK_HOME to it, or set TVM_NDK_CC "
            f"(or --cross-cc) to its {NDK_BIN}/{arch}-linux-android<API>-clang++")
    return Toolchain(triple, found, "android", arch)


def _linux(triple: str, cross_cc: str | None) -> Toolchain:
    arch = _arch(triple)
    named = cross_cc or os.environ.get(CROSS_CC_ENV)
    if named:
        return Toolchain(triple, _check_named(named, triple, "--cross-cc" if cross_cc else CROSS_CC_ENV), "linux", arch)
    prefix = _GNU_PREFIX.get(arch, f"{arch}-linux-gnu")
    for name in (f"{prefix}-g++", f"{prefix}-gcc", f"{triple}-g++"):
        found = _executable(name)
        if found:
            return Toolchain(triple, found, "linux", arch)
    package = DEBIAN_CROSS_PACKAGES.get(arch, f"g++-{prefix}")
    raise QtvmError(f"no C++ cross compiler for {triple} found ({prefix}-g++ is not on PATH)",
                    f"install it (Debian/Ubuntu: apt-get install {package}) or name one with --cross-cc "
                    f"or {CROSS_CC_ENV}")


def toolchain_for(target, cross_cc: str | None = None) -> Toolchain | None:
    """The cross toolchain the target's host triple needs; None when it is this machine's."""
    triple = host_triple(target)
    if not triple:
        if cross_cc:
            raise QtvmError("--cross-cc is given but the target builds for this machine",
                            "give the device's triple, e.g. --target 'llvm -mtriple=aarch64-linux-gnu'")
        return None
    arch = _arch(triple)
    if "android" in triple:
        chain = _android(triple, cross_cc)
    elif "linux" in triple:
        if arch == build_arch() and not cross_cc:
            return None
        chain = _linux(triple, cross_cc)
    else:
        raise QtvmError(f"cannot export for {triple}: qtvm links for Linux and Android hosts",
                        "use e.g. -mtriple=aarch64-linux-gnu or -mtriple=aarch64-linux-android")
    built_for = _arch(chain.dumpmachine() or triple)
    if built_for != arch:
        raise QtvmError(f"compiler '{chain.cc}' builds for {built_for}, not for {triple}",
                        f"name a compiler for {triple} with --cross-cc")
    return chain


def lifts_weights(toolchain: Toolchain | None) -> bool:
    """Whether the export can link the weights as a blob of their own (``qtvm.deploy.weights``):
    where it links by ``.incbin`` (ELF). Elsewhere they stay the VM's constants."""
    return toolchain is not None or sys.platform.startswith("linux")


def export_library(ex, path: str | os.PathLike, toolchain: Toolchain | None, weights: list | None = None) -> None:
    """Export ``ex`` (a Relax executable or runtime module) to ``path``, linked by
    ``toolchain`` when cross building and then checked with readelf (raises QtvmError);
    ``weights``: the lifted weights its entry points take (``lifts_weights`` must hold), linked in
    as their blob. The caller owns ``path`` (a temp file it renames into place)."""
    if weights and not lifts_weights(toolchain):
        raise QtvmError("internal: lifted weights on a platform without .incbin", "report this")
    if toolchain is None:  # the assembler directives are ELF's: elsewhere TVM's packer
        pack = _pack_imports_by_incbin(build_arch(), weights) if sys.platform.startswith("linux") else None
        ex.export_library(str(path), fpack_imports=pack)
        return
    from qtvm.deploy import elf

    try:
        ex.export_library(str(path), fcompile=toolchain.fcompile(),
                          fpack_imports=_pack_imports_by_incbin(toolchain.arch, weights))
    except RuntimeError as e:  # the linker's message, not TVM's trace
        lines = [line for line in str(e).splitlines() if line.strip()]
        raise QtvmError(f"linking for {toolchain.triple} with {toolchain.cc} failed: "
                        f"{(lines[1] if len(lines) > 1 else lines[0] if lines else '')[:300]}") from None
    problems = elf.check_artefact(path, toolchain)
    if problems:
        raise QtvmError(f"the {toolchain.triple} artefact fails its readelf check: {'; '.join(problems)}")


def _incbin(section: str, symbol: str, data: str, size: int, align: int) -> str:
    return (f'\t.section {section},"a",%progbits\n\t.globl {symbol}\n\t.type {symbol}, %object\n'
            f'\t.balign {align}\n{symbol}:\n\t.incbin "{data}"\n\t.size {symbol}, {size}\n')


def _pack_imports_by_incbin(arch: str, weights: list | None = None):
    """``export_library``'s ``fpack_imports``: the serialized imports (the VM's bytecode and
    constants) written to a file the assembler links in with ``.incbin``, under the symbol
    TVM's loader looks up, and the lifted ``weights`` as their blob (``qtvm.deploy.weights``)
    beside it. TVM's own packer copies the imports into an LLVM constant and then into an
    object in memory: ~5x the weights at the peak (15.5 GB to export 2.5 GB of int4 weights)
    when they are constants; this holds them twice, while TVM serializes them."""
    import numpy as np
    import tvm

    from qtvm.deploy.weights import DATA_ALIGN, SYMBOL, write_blob

    def pack(module, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
        if is_system_lib:  # TVM's packer would also register the blob with the system library
            raise QtvmError("internal: qtvm does not export system libraries", "report this")
        blob = tvm.get_global_func("runtime.ModulePackImportsToTensor")(module)
        data = os.path.join(workspace_dir, "imports.bin")
        np.from_dlpack(blob).tofile(data)
        size = int(blob.shape[0])
        del blob
        symbol = prefix + tvm.get_global_func("runtime.ModuleImportsBlobName")()
        # x86-64: a large section, laid out past the code and data its +-2 GiB addressing reaches
        section = ".lrodata" if arch == "x86_64" else ".rodata"
        text = _incbin(section, symbol, data, size, 8)
        if weights:
            blob_path = os.path.join(workspace_dir, "weights.bin")
            text += _incbin(section, SYMBOL, blob_path, write_blob(weights, blob_path), DATA_ALIGN)
        source = os.path.join(workspace_dir, "imports.s")
        with open(source, "w") as f:
            f.write(text)
        return source

    return pack
