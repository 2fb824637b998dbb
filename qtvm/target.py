"""Target strings as users type them -> ``tvm.target.Target``.

TVM 0.27 only takes dict targets; users (and every TVM tutorial) write
``llvm -mcpu=znver2 -mattr=+avx2,+fma -num-cores=4``. Both forms, and JSON,
are accepted here.
"""
from __future__ import annotations

import json
import re
import shlex

import tvm
from tvm.target import codegen

from qtvm.errors import QtvmError

KINDS = ("llvm", "cuda", "opencl")
LIST_OPTIONS = {"mattr", "keys", "libs", "cl-opt"}
INT_OPTIONS = {"num-cores", "max_num_threads", "thread_warp_size", "max_threads_per_block", "registers_per_block",
               "l2_cache_size_bytes",
               "max_shared_memory_per_block", "opt-level"}
HOST_ALIASES = ("host", "native")
#: NVIDIA architectures qtvm builds for (checked with ptxas for sm_80 and sm_90).
CUDA_ARCHS = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90")
#: What a bare ``cuda -arch=sm_XX`` implies (per-block limits every such GPU has; the L2 size
#: of the arch's datacenter part, which the cold-cache benchmark and tuner size buffers by).
CUDA_DEFAULTS = {"max_num_threads": 1024, "max_threads_per_block": 1024, "thread_warp_size": 32,
                 "max_shared_memory_per_block": 49152, "registers_per_block": 65536}
CUDA_L2_BYTES = {"sm_80": 40 << 20, "sm_86": 6 << 20, "sm_87": 4 << 20, "sm_89": 72 << 20, "sm_90": 50 << 20}


def host_cpu() -> str:
    return str(codegen.llvm_get_system_cpu())


def parse_target_dict(text: str) -> dict:
    """``llvm -mcpu=x -mattr=+a,+b`` (or JSON, or ``host``) -> a target dict."""
    text = text.strip()
    if not text:
        raise QtvmError("empty target", "try --target host or --target 'llvm -mcpu=znver2'")
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise QtvmError(f"target JSON does not parse ({e.msg})") from None
    words = shlex.split(text)
    kind, options = words[0], words[1:]
    if kind in HOST_ALIASES:
        kind, options = "llvm", [f"-mcpu={host_cpu()}", *options]
    if kind not in KINDS:
        raise QtvmError(f"unknown target kind '{kind}'", f"use one of: {', '.join(KINDS)}, host")
    out: dict = {"kind": kind}
    for word in options:
        if not word.startswith("-") or "=" not in word:
            raise QtvmError(f"target option '{word}' is not of the form -key=value",
                            "e.g. -mcpu=znver2 -mattr=+avx2,+fma")
        key, value = word.lstrip("-").split("=", 1)
        if key in LIST_OPTIONS:
            out[key] = [v for v in value.split(",") if v]
        elif key in INT_OPTIONS:
            try:
                out[key] = int(value)
            except ValueError:
                raise QtvmError(f"target option -{key} needs an integer, got '{value}'") from None
        else:
            out[key] = value
    if kind == "opencl" and "keys" in out:  # -device=mali: TVM's own keys stay (GPU pipelines read "gpu")
        out["keys"] += [k for k in ("opencl", "gpu") if k not in out["keys"]]
    return out


def _gpu_defaults(spec: dict) -> dict:
    """A CUDA target gets its arch checked and its limits filled in. The host stays as given
    (none: this machine; ``qtvm.deploy.toolchain.with_default_host`` gives Mali/Adreno an
    aarch64 host)."""
    if spec["kind"] == "cuda":
        arch = spec.get("arch")
        if arch is None:
            raise QtvmError("a cuda target needs its GPU architecture",
                            f"add -arch=, e.g. --target cuda -arch=sm_90 (one of {', '.join(CUDA_ARCHS)})")
        if not re.fullmatch(r"sm_\d+a?", str(arch)) or str(arch).rstrip("a") not in CUDA_ARCHS:
            raise QtvmError(f"unsupported CUDA architecture '{arch}'", f"use one of: {', '.join(CUDA_ARCHS)}")
        spec = {**CUDA_DEFAULTS, "l2_cache_size_bytes": CUDA_L2_BYTES[str(arch).rstrip("a")], **spec}
    if spec["kind"] == "opencl" and "device" in spec:  # keys come from TVM: (device, "opencl", "gpu")
        from schedules.opencl import device

        row = device(tvm.target.Target({k: v for k, v in spec.items() if k != "host"}))
        if row is None:
            raise QtvmError(f"unknown OpenCL device '{spec['device']}'",
                            "use -device=mali (add -model=bifrost for a Bifrost Mali) or -device=adreno, "
                            "or no -device for a generic OpenCL GPU")
        spec = {**row.target_attrs(), **spec}
    return spec


def parse_target(text: str) -> tvm.target.Target:
    spec = _gpu_defaults(parse_target_dict(text))
    if spec["kind"] == "llvm" and "mcpu" in spec and not codegen.llvm_is_valid_cpu(spec["mcpu"], spec.get("mtriple", "x86_64-unknown-linux-gnu")):
        raise QtvmError(f"LLVM does not know the CPU '{spec['mcpu']}'",
                        "use an LLVM CPU name such as znver2, znver3, skylake-avx512, sapphirerapids, or host")
    try:
        return tvm.target.Target(spec)
    except Exception as e:  # TVM reports bad attributes with a long C++ trace
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise QtvmError(f"invalid target {json.dumps(spec)}: {first}") from None


def with_host(target: tvm.target.Target, host: str | tvm.target.Target | None) -> tvm.target.Target:
    """``target`` with ``host`` (``--host``: an llvm target string) as the CPU part of a device target."""
    if host is None:
        return target
    host = parse_target(host) if isinstance(host, str) else host
    if host.kind.name != "llvm":
        raise QtvmError(f"--host must be an llvm (CPU) target, got kind '{host.kind.name}'",
                        "e.g. --host 'llvm -mtriple=aarch64-linux-gnu'")
    if target.kind.name == "llvm":
        raise QtvmError("--host is for device targets (opencl, cuda); an llvm target is its own host",
                        "put -mtriple=... on --target instead")
    return tvm.target.Target(target, host=host)


def split_cli_target(argv: list[str]) -> list[str]:
    """Join ``--target llvm -mcpu=x -mattr=y`` (unquoted; also ``--host``) into one argument."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        out.append(word)
        if word in ("--target", "--host") and i + 1 < len(argv):
            parts = [argv[i + 1]]
            i += 2
            while i < len(argv) and argv[i].startswith("-") and not argv[i].startswith("--") and "=" in argv[i]:
                parts.append(argv[i])
                i += 1
            out.append(" ".join(parts))
            continue
        i += 1
    return out


def cpu_flags_required(target: tvm.target.Target) -> list[str]:
    """/proc/cpuinfo flags the code built for this target needs (x86 only)."""
    if target.kind.name != "llvm":
        return []
    wanted = {"avx512f": "avx512f", "avx2": "avx2", "fma": "fma", "avx512bw": "avx512bw",
              "avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni"}
    with target:
        return sorted(flag for feat, flag in wanted.items() if codegen.llvm_cpu_has_features(feat, target))


def gpu_required(target: tvm.target.Target) -> dict:
    """What an artefact built for ``target`` needs of the GPU (metadata; the runtime checks it)."""
    if target.kind.name == "cuda":
        return {"device": "cuda", "required_gpu_arch": str(target.attrs["arch"])}
    if target.kind.name == "opencl":
        return {"device": "opencl"}
    return {}
