from __future__ import annotations

import pytest

from qtvm.errors import QtvmError
from qtvm.target import cpu_flags_required, parse_target, parse_target_dict, split_cli_target


@pytest.mark.parametrize("text,expected", [
    ("llvm -mcpu=znver2", {"kind": "llvm", "mcpu": "znver2"}),
    ("llvm -mcpu=skylake-avx512 -mattr=+avx512f,+fma -num-cores=4",
     {"kind": "llvm", "mcpu": "skylake-avx512", "mattr": ["+avx512f", "+fma"], "num-cores": 4}),
    ('{"kind": "llvm", "mcpu": "znver3"}', {"kind": "llvm", "mcpu": "znver3"}),
    ("cuda -arch=sm_80", {"kind": "cuda", "arch": "sm_80"}),
])
def test_classic_strings_translate(text, expected):
    assert parse_target_dict(text) == expected
    assert parse_target(text).kind.name == expected["kind"]


def test_host_resolves_to_a_real_cpu():
    target = parse_target("host")
    assert target.kind.name == "llvm" and str(target.attrs["mcpu"]) not in ("", "generic")


def test_required_flags():
    assert cpu_flags_required(parse_target("llvm -mcpu=znver2")) == ["avx2", "fma"]
    assert "avx512f" in cpu_flags_required(parse_target("llvm -mcpu=skylake-avx512"))


@pytest.mark.parametrize("text,needle", [
    ("", "empty target"), ("tpu", "unknown target kind 'tpu'"), ("llvm mcpu", "-key=value"),
    ("llvm -mcpu=notacpu", "does not know the CPU"), ("llvm -num-cores=x", "needs an integer"),
    ("llvm -bogus=1", "invalid target"), ("{bad json", "does not parse"),
])
def test_invalid_targets(text, needle):
    with pytest.raises(QtvmError, match=needle):
        parse_target(text)


def test_unquoted_cli_target_is_joined():
    argv = ["compile", "m.onnx", "--target", "llvm", "-mcpu=znver2", "-mattr=+avx2", "-o", "x.so"]
    assert split_cli_target(argv) == ["compile", "m.onnx", "--target", "llvm -mcpu=znver2 -mattr=+avx2", "-o", "x.so"]
