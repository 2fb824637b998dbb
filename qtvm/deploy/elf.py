"""What an artefact is, read with ``readelf`` (binutils) without loading it.

A cross-built artefact cannot be loaded on the build machine, so it is checked as a
file: the ELF machine, the shared libraries it needs (libc and friends only: the TVM
runtime comes from the process that loads it), the kernels it exports
(``__tvm_ffi_<name>``), and the embedded module blob (``__tvm_ffi__library_bin``),
which holds the Relax VM executable with its ``qtvm_metadata`` function and the
metadata JSON as a constant.  The metadata is read back from that blob, so
``qtvm inspect`` works on artefacts for other machines.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from qtvm.errors import QtvmError

METADATA_FUNC = "qtvm_metadata"
LIBRARY_BIN = "__tvm_ffi__library_bin"
KERNEL_PREFIX = "__tvm_ffi_"
#: Shared libraries an artefact may need, per system (anything else would have to be
#: shipped to the device with it).
ALLOWED_DEPS = {
    "linux": {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "libgcc_s.so.1", "libstdc++.so.6",
              "ld-linux-aarch64.so.1", "ld-linux-x86-64.so.2", "ld-linux-armhf.so.3", "ld-linux-riscv64-lp64d.so.1"},
    "android": {"libc.so", "libm.so", "libdl.so", "liblog.so"},
}
ELF_MAGIC = b"\x7fELF"
_E_MACHINE = {0x3E: "Advanced Micro Devices X86-64", 0xB7: "AArch64", 0x28: "ARM", 0xF3: "RISC-V", 0x03: "Intel 80386"}


@dataclass
class ElfInfo:
    path: Path
    machine: str  # readelf's name, e.g. "AArch64"
    elf_type: str  # "DYN (Shared object file)"
    needed: list[str] = field(default_factory=list)
    exported: list[str] = field(default_factory=list)  # defined global dynamic symbols
    library_bin: bytes | None = None

    @property
    def kernels(self) -> list[str]:
        return sorted(s[len(KERNEL_PREFIX):] for s in self.exported
                      if s.startswith(KERNEL_PREFIX) and s != LIBRARY_BIN)

    @property
    def has_metadata_function(self) -> bool:
        return self.library_bin is not None and METADATA_FUNC.encode() in self.library_bin


def elf_machine(path: str | os.PathLike) -> str | None:
    """The ELF machine from the header (no readelf needed); None if not an ELF file."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != ELF_MAGIC:
        return None
    endian = "<" if head[5] == 1 else ">"
    (code,) = struct.unpack(endian + "H", head[18:20])
    return _E_MACHINE.get(code, f"machine {code:#x}")


def _readelf(args: list[str], path: Path) -> str:
    exe = shutil.which("readelf")
    if exe is None:
        raise QtvmError("readelf is not installed", "install binutils (apt-get install binutils)")
    proc = subprocess.run([exe, *args, "-W", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise QtvmError(f"readelf cannot read '{path}': {proc.stderr.strip().splitlines()[-1][:200]}")
    return proc.stdout


def read_elf(path: str | os.PathLike) -> ElfInfo:
    path = Path(path)
    if not path.is_file():
        raise QtvmError(f"artefact '{path}' does not exist")
    if elf_machine(path) is None:
        raise QtvmError(f"'{path}' is not an ELF shared library", "compile one with `qtvm compile`")
    header = _readelf(["-h"], path)
    machine = re.search(r"^\s*Machine:\s*(.+)$", header, re.M).group(1).strip()
    elf_type = re.search(r"^\s*Type:\s*(.+)$", header, re.M).group(1).strip()
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _readelf(["-d"], path))
    symbols: dict[str, tuple[int, int]] = {}
    for line in _readelf(["--dyn-syms"], path).splitlines():
        parts = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(parts) >= 8 and parts[0].endswith(":") and parts[4] in ("GLOBAL", "WEAK") and parts[6] != "UND":
            size = int(parts[2], 16) if parts[2].startswith("0x") else int(parts[2])
            symbols[parts[7].split("@")[0]] = (int(parts[1], 16), size)
    info = ElfInfo(path, machine, elf_type, needed, sorted(symbols))
    if LIBRARY_BIN in symbols:
        info.library_bin = _symbol_bytes(path, *symbols[LIBRARY_BIN])
    return info


def _symbol_bytes(path: Path, address: int, size: int) -> bytes | None:
    """The bytes of a data symbol: its address mapped to a file offset by the section table."""
    for line in _readelf(["-S"], path).splitlines():
        m = re.match(r"^\s*\[\s*\d+\]\s+(\S+)\s+(\S+)\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if not m or m.group(2) == "NOBITS":
            continue
        start, offset, length = int(m.group(3), 16), int(m.group(4), 16), int(m.group(5), 16)
        if start <= address and address + size <= start + length and start:
            with open(path, "rb") as f:
                f.seek(offset + address - start)
                return f.read(size)
    return None


def embedded_metadata(info: ElfInfo) -> dict | None:
    """The metadata JSON stored as a uint8 constant (length-prefixed) in the module blob."""
    blob = info.library_bin
    if not blob or not info.has_metadata_function:
        return None
    for m in re.finditer(rb'\{"', blob):
        start = m.start()
        if start < 8:
            continue
        (length,) = struct.unpack("<Q", blob[start - 8:start])
        if not 2 <= length <= len(blob) - start:
            continue
        try:
            meta = json.loads(blob[start:start + length].decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(meta, dict) and {"inputs", "outputs", "target"} <= set(meta):
            return meta
    return None


def check_artefact(path: str | os.PathLike, toolchain) -> list[str]:
    """Problems of a cross-built artefact (empty when it is what the device can load)."""
    info = read_elf(path)
    problems = []
    if info.machine != toolchain.elf_machine:
        problems.append(f"ELF machine is {info.machine}, expected {toolchain.elf_machine}")
    if not info.elf_type.startswith("DYN"):
        problems.append(f"ELF type is {info.elf_type}, expected a shared object")
    allowed = ALLOWED_DEPS.get(toolchain.system, set())
    extra = sorted(set(info.needed) - allowed)
    if extra:
        problems.append(f"needs shared libraries the device may lack: {', '.join(extra)}")
    if not info.kernels:
        problems.append("exports no kernels (__tvm_ffi_* symbols)")
    if not info.has_metadata_function or embedded_metadata(info) is None:
        problems.append(f"no {METADATA_FUNC} function with its metadata in the module blob")
    return problems



def _this_machine() -> str:
    from qtvm.deploy.toolchain import ELF_MACHINES, build_arch

    return ELF_MACHINES.get(build_arch(), build_arch())


def foreign_metadata(path: str | os.PathLike) -> dict | None:
    """Metadata of an artefact built for another machine (read from the file); None for
    one this machine can load (the runtime reads it then)."""
    path = Path(path)
    if not path.is_file():
        return None
    machine = elf_machine(path)
    if machine is None or machine == _this_machine():
        return None
    meta = embedded_metadata(read_elf(path))
    if meta is None:
        raise QtvmError(f"'{path}' ({machine}) has no qtvm metadata (not built by qtvm?)")
    return {**meta, "elf_machine": machine}


def refuse_foreign(path: str | os.PathLike) -> None:
    """A one-line error for running another machine's artefact here."""
    path = Path(path)
    machine = elf_machine(path) if path.is_file() else None
    if machine is not None and machine != _this_machine():
        raise QtvmError(f"'{path}' is built for {machine}, this machine is {_this_machine()}",
                        "run it on the device (qtvm bundle-runtime gives a loader), or inspect it with qtvm inspect")
