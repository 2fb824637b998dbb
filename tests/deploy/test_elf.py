"""A cross-built aarch64 artefact, checked as a file with readelf: machine, dynamic
deps, exported kernels, and the qtvm metadata read back from the embedded module."""
from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest

from qtvm.cli import main
from qtvm.deploy import elf, toolchain
from qtvm.errors import QtvmError
from qtvm.pipeline import compile_model
from qtvm.target import parse_target
from tests.conftest import mlp_model
from tests.deploy.cross import AARCH64, CXX, require_tool


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    """(aarch64 CompileResult, host CompileResult) of the same MLP."""
    require_tool(CXX, "g++-aarch64-linux-gnu")
    require_tool("readelf", "binutils")
    d = tmp_path_factory.mktemp("cross")
    onnx.save(mlp_model(), str(d / "mlp.onnx"))
    arm = compile_model(d / "mlp.onnx", d / "mlp_aarch64.so", AARCH64, "int4-g128")
    native = compile_model(d / "mlp.onnx", d / "mlp_host.so", "host", "int4-g128")
    return arm, native


def test_readelf_facts_of_the_aarch64_artefact(artefacts):
    arm, _ = artefacts
    info = elf.read_elf(arm.path)
    assert info.machine == "AArch64" and info.elf_type.startswith("DYN")
    assert info.needed == ["libc.so.6"]  # the TVM runtime comes from the loading process
    assert not any("tvm" in lib for lib in info.needed)
    assert {"qmatmul_int4_g128_100x70", "qmatmul_int4_g128_70x37"} <= set(info.kernels)
    assert info.has_metadata_function
    assert elf.embedded_metadata(info) == arm.metadata
    assert json.loads(elf.embedded_metadata(info)["target"])["mtriple"] == "aarch64-linux-gnu"
    chain = toolchain.toolchain_for(parse_target(AARCH64))
    assert elf.check_artefact(arm.path, chain) == []
    assert any("cross-built for aarch64-linux-gnu" in note for note in arm.notes)


def test_readelf_agrees_on_the_host_artefact(artefacts):
    _, native = artefacts
    info = elf.read_elf(native.path)
    assert info.machine == elf.elf_machine(native.path) == "Advanced Micro Devices X86-64"
    assert elf.embedded_metadata(info) == native.metadata
    assert elf.foreign_metadata(native.path) is None  # this machine's: the runtime reads it


def test_check_flags_what_a_device_could_not_load(artefacts, tmp_path):
    arm, native = artefacts
    chain = toolchain.toolchain_for(parse_target(AARCH64))
    problems = elf.check_artefact(native.path, chain)
    assert any("ELF machine is Advanced Micro Devices X86-64, expected AArch64" in p for p in problems)
    android = toolchain.Toolchain("aarch64-linux-android28", chain.cc, "android", "aarch64")
    assert any("libc.so.6" in p for p in elf.check_artefact(arm.path, android))  # glibc, not bionic
    plain = tmp_path / "plain.so"  # an aarch64 library that is not a qtvm artefact
    src = tmp_path / "plain.c"
    src.write_text("int f(int x) { return x + 1; }\n")
    subprocess.run([chain.cc, "-shared", "-fPIC", "-o", str(plain), str(src)], check=True, timeout=120)
    problems = elf.check_artefact(plain, chain)
    assert any("exports no kernels" in p for p in problems) and any("qtvm_metadata" in p for p in problems)
    with pytest.raises(QtvmError, match="not an ELF"):
        elf.read_elf(src)


def test_inspect_and_run_on_a_foreign_artefact(artefacts, capsys):
    arm, _ = artefacts
    assert main(["inspect", "--json", str(arm.path)]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["elf_machine"] == "AArch64" and meta["inputs"] == arm.metadata["inputs"]
    assert main(["run", str(arm.path)]) == 2
    err = capsys.readouterr().err
    assert "built for AArch64" in err and len(err.strip().splitlines()) == 1


def test_cli_cross_compile_reports_the_check(artefacts, tmp_path):
    """The user's command line, unquoted target, through the real CLI process."""
    model = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(k=64, hidden=32, n=16), str(model))
    out = tmp_path / "m.so"
    proc = subprocess.run([sys.executable, "-m", "qtvm.cli", "compile", str(model), "--target", "llvm",
                           "-mtriple=aarch64-linux-gnu", "-mattr=+neon", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "cross-built for aarch64-linux-gnu" in proc.stdout and "AArch64" in proc.stdout
    assert elf.read_elf(out).machine == "AArch64"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_opencl_device_target_on_an_aarch64_host(tmp_path):
    """The export a Mali/Adreno artefact gets: the host code linked for aarch64 by the cross
    toolchain, the OpenCL kernels carried in the module blob next to qtvm_metadata.  (Built
    from a relu scheduled by dlight: qtvm's own OpenCL rules are another module's.)"""
    import tvm
    from tvm import relax, topi
    from tvm.s_tir import dlight as dl

    from qtvm.pipeline import _metadata_function
    from qtvm.target import with_host

    require_tool(CXX, "g++-aarch64-linux-gnu")
    device = tvm.target.Target({"kind": "opencl", "device": "mali", "keys": ["mali", "opencl", "gpu"]})
    target = with_host(device, "llvm -mtriple=aarch64-linux-gnu")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([tvm.tirx.Var("n", "int64"), 64], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit_te(topi.nn.relu, x))
        bb.emit_func_output(out)
    with target:
        mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(bb.get())
    meta = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["n", 64]}], "outputs": [], "target": str(target)}
    mod["qtvm_metadata"] = _metadata_function(meta)
    ex = tvm.compile(mod, target=target)
    chain = toolchain.toolchain_for(target)
    assert chain is not None and chain.triple == "aarch64-linux-gnu"
    path = tmp_path / "relu_mali.so"
    toolchain.export_library(ex, path, chain)  # raises if readelf finds a problem
    info = elf.read_elf(path)
    assert info.machine == "AArch64" and "relu" in info.kernels
    assert b"__kernel" in info.library_bin  # the OpenCL source travels inside
    assert elf.embedded_metadata(info) == meta


def test_the_embedded_module_is_linked_from_a_file(artefacts):
    """The export links TVM's serialized module with ``.incbin`` (``toolchain._pack_imports_by_incbin``):
    the loader's symbol, exported, in a large read-only section on x86-64 and in .rodata on aarch64,
    its size the blob's own (a uint64 length, then that many bytes)."""
    import struct

    blob_symbol = "__tvm_ffi__library_bin"
    native = ".lrodata" if toolchain.build_arch() == "x86_64" else ".rodata"
    for result, section in ((artefacts[0], ".rodata"), (artefacts[1], native)):
        sections = subprocess.run(["readelf", "-SW", str(result.path)], capture_output=True, text=True).stdout
        symbols = subprocess.run(["readelf", "-sW", "--dyn-syms", str(result.path)], capture_output=True,
                                 text=True).stdout
        row = next(line.split() for line in symbols.splitlines() if line.rstrip().endswith(blob_symbol))
        value, size, index = int(row[1], 16), int(row[2]), row[6]
        header = next(line for line in sections.splitlines() if f"[{index.rjust(2)}]" in line)
        assert header.split("]")[1].split()[0] == section, header
        address, offset = (int(x, 16) for x in header.split("]")[1].split()[2:4])
        with open(result.path, "rb") as f:
            f.seek(offset + value - address)
            assert struct.unpack("<Q", f.read(8))[0] == size - 8
