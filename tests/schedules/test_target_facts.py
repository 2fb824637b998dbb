"""cpu_facts / host_supports: table targets, mattr, host reading, errors."""

import dataclasses
import os
from pathlib import Path

import pytest
import tvm
from tvm.target import codegen

from schedules.target_facts import (
    CPU_TABLE,
    CpuFacts,
    cpu_facts,
    host_facts,
    host_isa,
    host_llvm_cpu,
    host_supports,
    known_mcpus,
    resolve_host_target,
    table_facts,
)

KIB = 1024
MIB = 1024 * 1024


def target(**attrs):
    return tvm.target.Target({"kind": "llvm", **attrs})


def proc_flags() -> set[str]:
    """The host's CPU flags, read here independently of the module under test."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("no flags line in /proc/cpuinfo")


def expected_host_isa() -> str:
    flags = proc_flags()
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "generic"


# ------------------------------------------------------------------ table rows


# The value checks go through table_facts (never the host), so they hold on any
# machine; test_cpu_facts_uses_the_table_unless_host ties cpu_facts to it.


def test_znver2_is_avx2_with_zen2_caches():
    f = table_facts("znver2")
    assert (f.isa, f.vector_bits, f.f32_lanes, f.vector_registers) == ("avx2", 256, 8, 16)
    assert f.fma_ports == 2
    assert (f.l1d_bytes, f.l2_bytes, f.l3_bytes) == (32 * KIB, 512 * KIB, 16 * MIB)
    assert (f.source, f.mcpu) == ("table", "znver2")


def test_skylake_avx512_is_avx512_with_32_zmm():
    f = table_facts("skylake-avx512")
    assert (f.isa, f.vector_bits, f.f32_lanes, f.vector_registers) == ("avx512", 512, 16, 32)
    assert f.fma_ports == 2
    assert (f.l1d_bytes, f.l2_bytes) == (32 * KIB, 1 * MIB)


def test_sapphirerapids_caches():
    f = table_facts("sapphirerapids")
    assert (f.isa, f.f32_lanes, f.vector_registers, f.fma_ports) == ("avx512", 16, 32, 2)
    assert (f.l1d_bytes, f.l2_bytes, f.l3_bytes) == (48 * KIB, 2 * MIB, 105 * MIB)


def test_znver4_avx512_is_double_pumped():
    f = table_facts("znver4")
    assert f.isa == "avx512" and f.fma_ports == 1  # two 256-bit pipes = one 512-bit FMA/cycle
    assert table_facts("znver3").isa == "avx2"


@pytest.mark.parametrize(
    "mcpu",
    ["znver2", "znver3", "znver4", "haswell", "skylake", "skylake-avx512", "cascadelake",
     "icelake-server", "sapphirerapids", "x86-64-v3", "x86-64-v4"],
)
def test_cpu_facts_uses_the_table_unless_host(mcpu):
    assert mcpu in known_mcpus()
    f = cpu_facts(target(mcpu=mcpu))
    if mcpu == host_llvm_cpu():
        assert f.source == "host" and f.isa == expected_host_isa()
    else:
        assert f == table_facts(mcpu)


@pytest.mark.parametrize("mcpu", sorted(CPU_TABLE))
def test_table_isa_agrees_with_llvm(mcpu):
    """Each row's ISA is what LLVM enables for that CPU name."""
    t = target(mcpu=mcpu)
    spec = CPU_TABLE[mcpu]
    assert bool(codegen.llvm_is_valid_cpu(mcpu, "x86_64-linux-gnu"))
    assert bool(codegen.llvm_cpu_has_features("avx512f", t)) == (spec.isa == "avx512")
    assert bool(codegen.llvm_cpu_has_features("avx2", t)) == (spec.isa in ("avx2", "avx512"))
    if spec.isa != "generic":
        assert bool(codegen.llvm_cpu_has_features("fma", t))


# ----------------------------------------------------------------------- mattr


def test_mattr_plus_avx512f_turns_on_avx512_on_any_cpu():
    f = table_facts("znver2", ["+avx512f"])
    assert (f.isa, f.f32_lanes, f.vector_registers) == ("avx512", 16, 32)
    assert f.l1d_bytes == 32 * KIB  # caches stay the CPU's
    assert table_facts("x86-64", ["+avx512f"]).isa == "avx512"
    # through a Target, on the host as on any table CPU
    assert cpu_facts(target(mcpu="znver2", mattr=["+avx512f"])).isa == "avx512"
    assert cpu_facts(target(mattr=["+avx512f"])).isa == "avx512"


def test_mattr_minus_avx512f_and_comma_lists():
    f = table_facts("sapphirerapids", ["-avx512f"])
    assert (f.isa, f.f32_lanes, f.vector_registers) == ("avx2", 8, 16)
    assert table_facts("x86-64", "+avx2,+fma").isa == "avx2"
    assert cpu_facts(target(mcpu="x86-64", mattr=["+avx2,+fma"])).isa == "avx2"
    h = table_facts("znver3", ["-avx2"])
    assert (h.isa, h.vector_bits, h.f32_lanes) == ("generic", 128, 4)
    assert cpu_facts(target(mattr=["-avx512f", "-avx2"])).isa == "generic"


def test_num_cores_overrides_cores():
    assert cpu_facts(target(mcpu="znver3", **{"num-cores": 3})).cores == 3
    assert cpu_facts(target(**{"num-cores": 3})).cores == 3
    assert table_facts("znver3").cores == CPU_TABLE["znver3"].cores == 64


# ------------------------------------------------------------------------ host


def test_host_facts_come_from_this_machine():
    for t in (target(), target(mcpu="native"), target(mcpu=host_llvm_cpu())):
        f = cpu_facts(t)
        assert f.source == "host"
        assert f.isa == expected_host_isa()
        assert f.mcpu == host_llvm_cpu()
        assert f.cores == len(os.sched_getaffinity(0))
    assert host_facts() == cpu_facts(target())


def test_host_cache_sizes_match_sysfs():
    f = host_facts()
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    seen = {}
    for index in root.glob("index*"):
        level = int((index / "level").read_text())
        kind = (index / "type").read_text().strip()
        size = (index / "size").read_text().strip()
        if kind in ("Data", "Unified"):
            assert size[-1] in "KM"
            seen[level] = int(size[:-1]) * (KIB if size[-1] == "K" else MIB)
    got = {1: f.l1d_bytes, 2: f.l2_bytes, 3: f.l3_bytes}
    for level, size in seen.items():
        assert got[level] == size
    assert f.l1d_bytes >= 16 * KIB


def test_host_isa_matches_proc_cpuinfo():
    assert host_isa() == expected_host_isa()


def test_host_supports_follows_the_host_flags():
    flags = proc_flags()
    avx512 = table_facts("skylake-avx512")
    avx2 = table_facts("znver2")
    base = table_facts("x86-64")
    # On an AVX2-only host (e.g. Zen 3) the first is False; on an AVX-512 host True.
    assert host_supports(avx512) == ("avx512f" in flags)
    assert host_supports(avx2) == ({"avx2", "fma"} <= flags or "avx512f" in flags)
    assert host_supports(base)
    assert host_supports(host_facts())


def test_host_supports_is_an_isa_order():
    fake = dataclasses.replace(table_facts("znver2"), isa="avx512", vector_bits=512,
                               f32_lanes=16, vector_registers=32)
    assert host_supports(fake) == (host_isa() == "avx512")


def test_resolve_host_target_spells_out_the_cpu():
    t = resolve_host_target(target(**{"num-cores": 2}))
    assert str(t.attrs["mcpu"]) == host_llvm_cpu()
    assert int(t.attrs["num-cores"]) == 2
    z = resolve_host_target({"kind": "llvm", "mcpu": "znver2"})
    assert str(z.attrs["mcpu"]) == "znver2"


# ---------------------------------------------------------------------- errors


def test_unknown_mcpu_names_it_and_lists_known_ones():
    with pytest.raises(ValueError) as err:
        cpu_facts(target(mcpu="pentium-pro-max"))
    text = str(err.value)
    assert "pentium-pro-max" in text
    for name in ("znver3", "sapphirerapids", "skylake-avx512", "x86-64-v3"):
        assert name in text
    assert "does not know" in text  # LLVM has no such CPU either


def test_llvm_cpu_missing_from_table_says_so():
    with pytest.raises(ValueError, match="add a row"):
        cpu_facts(target(mcpu="pentium4"))


def test_non_cpu_or_non_x86_targets_are_rejected():
    with pytest.raises(ValueError, match="LLVM"):
        cpu_facts(tvm.target.Target({"kind": "c"}))
    with pytest.raises(ValueError, match="x86"):
        cpu_facts(target(mtriple="aarch64-linux-gnu", mcpu="cortex-a76"))
    with pytest.raises(TypeError):
        cpu_facts("llvm -mcpu=znver2")


def test_cpufacts_validates():
    f = table_facts("znver2")
    with pytest.raises(ValueError):
        dataclasses.replace(f, f32_lanes=16)
    with pytest.raises(ValueError):
        dataclasses.replace(f, isa="neon")
    with pytest.raises(ValueError):
        dataclasses.replace(f, vector_registers=0)
    assert f.peak_gflops == pytest.approx(2 * 8 * 2 * 2.25 * 64)
    assert isinstance(f, CpuFacts)
