"""A runtime bundle for a device: TVM's runtime libraries and ``qtvm_run``.

The device needs ``libtvm_runtime.so`` and ``libtvm_ffi.so`` built for it, and a
loader.  For aarch64 Linux (and x86_64 Linux) the libraries are the ones inside the
PyPI wheels of the same apache-tvm / apache-tvm-ffi versions this qtvm uses, for the
device's platform, fetched with ``pip download``; ``qtvm_run`` (``qtvm_run.cc``) is built
with the same cross compiler as the artefacts.  Android has no such wheels: its
runtime is built from TVM's source with the NDK, or TVM's Android RPC app is used.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from qtvm.atomic import atomic_file
from qtvm.deploy.toolchain import Toolchain
from qtvm.errors import QtvmError

RUNNER_SOURCE = Path(__file__).with_name("qtvm_run.cc")
RUNTIME_LIBS = {"tvm/lib/libtvm_runtime.so": "libtvm_runtime.so", "tvm_ffi/lib/libtvm_ffi.so": "libtvm_ffi.so"}
WHEEL_PLATFORMS = {"aarch64": ("manylinux_2_28_aarch64", "manylinux2014_aarch64"),
                   "x86_64": ("manylinux_2_28_x86_64", "manylinux2014_x86_64")}


def _versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in ("apache-tvm", "apache-tvm-ffi")}


def default_cache(arch: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "qtvm" / f"tvm-runtime-{_versions()['apache-tvm']}-{arch}"


def runtime_libs(arch: str, dest: str | Path | None = None) -> Path:
    """A directory holding libtvm_runtime.so and libtvm_ffi.so for Linux on ``arch``
    (``dest``, default a per-version cache; downloaded once)."""
    dest = Path(dest) if dest is not None else default_cache(arch)
    if all((dest / name).is_file() for name in RUNTIME_LIBS.values()):
        return dest
    if arch not in WHEEL_PLATFORMS:
        raise QtvmError(f"no TVM runtime wheel for Linux on {arch}",
                        "build libtvm_runtime.so from TVM's source for the device")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qtvm-wheels-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}", "-d", tmp]
        for plat in WHEEL_PLATFORMS[arch]:
            cmd += ["--platform", plat]
        cmd += [f"{name}=={version}" for name, version in _versions().items()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise QtvmError(f"cannot download the TVM runtime wheels for {arch} ({last[:200]})",
                            "check that pip reaches the package index")
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                for member, name in RUNTIME_LIBS.items():
                    if member in z.namelist():
                        with atomic_file(dest / name) as f:
                            f.write(z.read(member))
    missing = [name for name in RUNTIME_LIBS.values() if not (dest / name).is_file()]
    if missing:
        raise QtvmError(f"the downloaded wheels lack {', '.join(missing)}")
    return dest


def installed_libs() -> dict[str, Path]:
    """This machine's runtime libraries: the installed wheels' own files."""
    import tvm_ffi

    site = Path(tvm_ffi.__file__).parent.parent
    return {name: site / member for member, name in RUNTIME_LIBS.items()}


def _include_dirs() -> list[str]:
    import tvm_ffi

    root = Path(tvm_ffi.__file__).parent
    return [str(root / "include"), str(root / "3rdparty" / "dlpack" / "include")]


def build_runner(toolchain: Toolchain | None, libs: Path, out: Path) -> Path:
    """Compile ``qtvm_run`` for the toolchain's triple (None: this machine) against ``libs``."""
    cc = toolchain.cc if toolchain is not None else (shutil.which("g++") or "c++")
    cmd = [cc, "-std=c++17", "-O2", *[f"-I{d}" for d in _include_dirs()], str(RUNNER_SOURCE), "-o", str(out),
           f"-L{libs}", "-ltvm_ffi", "-ltvm_runtime", "-ldl", "-Wl,-rpath,$ORIGIN"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise QtvmError(f"building qtvm_run with {cc} failed: {(proc.stderr.strip().splitlines() or ['?'])[0][:300]}")
    return out


def bundle(toolchain: Toolchain | None, out_dir: str | Path, cache: str | Path | None = None) -> Path:
    """``out_dir`` with qtvm_run + the runtime libraries: copy it and the artefact to the device."""
    if toolchain is not None and toolchain.system == "android":
        raise QtvmError("TVM publishes no Android runtime libraries",
                        "build libtvm_runtime.so with the NDK from TVM's source, or use TVM's Android RPC app")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if toolchain is None:
        sources = installed_libs()
    else:
        libs = runtime_libs(toolchain.arch, cache)
        sources = {name: libs / name for name in RUNTIME_LIBS.values()}
    for name, src in sources.items():
        if src.resolve() != (out_dir / name).resolve():
            shutil.copy2(src, out_dir / name)
    build_runner(toolchain, out_dir, out_dir / "qtvm_run")
    return out_dir
