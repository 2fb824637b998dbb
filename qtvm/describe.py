"""`qtvm inspect`: an artefact's metadata, read without running it, and a summary for people.

The metadata is read from the file (``qtvm.deploy.elf``: readelf, no loading), so an
artefact for another machine, or one needing CPU features this machine lacks, can still
be inspected; without readelf the runtime loads it.  The summary shows every key it
does not know at the end, so a key added later (``gpu_arch`` from the GPU targets) is
never hidden.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from qtvm.errors import QtvmError

# Keys the summary lays out itself; any other key is listed under "other".
_KNOWN = {"format", "activations", "target", "required_cpu_flags", "inputs", "outputs", "quantized_matmuls",
          "packed_bytes", "float_weight_bytes", "layers", "prequantized_matmuls", "prequantized",
          "elf_machine", "gpu_arch", "device", "dim_limits", "may_be_zero", "kv_step", "combined_matmuls",
          "bound_inputs", "dim_minimums", "routed_experts"}
# Metadata keys naming the GPU architecture a device artefact needs (the GPU targets add one).
GPU_ARCH_KEYS = ("required_gpu_arch", "gpu_arch", "cuda_arch", "sm")


def _combined(groups: list[list[int]]) -> str:
    """'40 matmuls sharing an input as 16 kernels: N = 2048+256+256 (x8), 5632+5632 (x8)'."""
    counts: dict[str, int] = {}
    for group in groups:
        key = "+".join(map(str, group))
        counts[key] = counts.get(key, 0) + 1
    widths = ", ".join(f"{key} (x{n})" if n > 1 else key for key, n in counts.items())
    return f"{sum(map(len, groups))} matmuls sharing an input as {len(groups)} kernels: N = {widths}"


def read_metadata(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise QtvmError(f"artefact '{path}' does not exist", "compile one with `qtvm compile`")
    from qtvm.deploy import elf

    foreign = elf.foreign_metadata(path)
    if foreign is not None:
        return foreign
    if elf.elf_machine(path) is None:
        raise QtvmError(f"'{path}' is not a qtvm artefact (not an ELF shared library)",
                        "compile one with `qtvm compile`")
    try:
        meta = elf.embedded_metadata(elf.read_elf(path))
    except QtvmError:  # no readelf here: let the runtime load it
        meta = None
    if meta is None:  # runtime.inspect also reads OpenCL artefacts, which this TVM cannot load
        from qtvm import runtime

        meta = runtime.inspect(path)
    return meta


def target_text(target) -> str:
    """The target as users type it (``llvm -mcpu=znver3 -mattr=+avx2``), from its JSON form."""
    if isinstance(target, str):
        try:
            target = json.loads(target)
        except json.JSONDecodeError:
            return target
    if not isinstance(target, dict):
        return str(target)
    words = [str(target.get("kind", "?"))]
    host = None
    for key, value in target.items():
        if key in ("kind", "tag", "keys") or value in ("", None, [], ()):
            continue
        if key == "host":
            host = value
            continue
        value = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        words.append(f"-{key}={value}")
    text = " ".join(words)
    return f"{text} (host: {target_text(host)})" if host else text


def _dims(spec: dict) -> str:
    return f"{spec['dtype']}[{', '.join(map(str, spec['shape']))}]"


def _size(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def summary(meta: dict, path: str | os.PathLike | None = None) -> str:
    """A few aligned lines: what the artefact needs and what it holds."""
    from qtvm.hostinfo import host_cpu_flags

    rows: list[tuple[str, str]] = []
    if path is not None:
        rows.append(("artefact", f"{path} ({_size(Path(path).stat().st_size)})"))
    rows.append(("target", target_text(meta.get("target", "?"))))
    if "elf_machine" in meta:
        rows.append(("machine", f"{meta['elf_machine']} (built for another machine)"))
    flags = list(meta.get("required_cpu_flags") or [])
    if flags:
        lacking = sorted(set(flags) - host_cpu_flags()) if "elf_machine" not in meta else []
        here = f"; this CPU lacks {', '.join(lacking)}: recompile with --target host" if lacking else ""
        rows.append(("CPU flags", f"{', '.join(flags)}{here}"))
    else:
        rows.append(("CPU flags", "none beyond the target's baseline"))
    for key in GPU_ARCH_KEYS:
        if key in meta:
            rows.append(("GPU arch", str(meta[key])))
    if meta.get("device") == "cuda":
        arch = meta.get("required_gpu_arch", "?")
        rows.append(("device", f"needs an NVIDIA GPU of architecture {arch} or newer (CUDA)"))
    elif meta.get("device") == "opencl":
        rows.append(("device", "needs an OpenCL device and a TVM runtime built with OpenCL"))
    ins = ", ".join(f"{s['name']}: {_dims(s)}" for s in meta.get("inputs", []))
    outs = ", ".join(f"{s['name']}: {_dims(s)}" for s in meta.get("outputs", []))
    rows.append(("signature", f"main({ins}) -> {outs}"))
    if meta.get("bound_inputs"):
        bound = ", ".join(f"{k}={v}" for k, v in meta["bound_inputs"].items())
        rows.append(("bound inputs", f"{bound} (fixed at compile time by --bind; not inputs of main)"))
    symbols = sorted({d for s in meta.get("inputs", []) for d in s["shape"] if isinstance(d, str)})
    if symbols:
        limits = meta.get("dim_limits") or {}
        zero = set(meta.get("may_be_zero") or [])
        sums = [f"{d} <= {top}" for d, top in limits.items() if d not in symbols]  # past + seq <= 256
        lows = {d: meta.get("dim_minimums", {}).get(d, 0 if d in zero else 1) for d in symbols}
        rows.append(("symbolic dims", ", ".join(
            [f"{d} {lows[d]}..{limits[d]}" if d in limits else f"{d}{f' >= {lows[d]}' if lows[d] != 1 else ''}"
             for d in symbols] + sums) + (" (any size at run time)" if not limits and max(lows.values()) <= 1 else "")))
    if "quantized_matmuls" in meta:
        packed, floats = meta.get("packed_bytes", 0), meta.get("float_weight_bytes", 0)
        bits = 32.0 * packed / floats if floats else float("nan")
        rows.append(("weights", f"{meta['quantized_matmuls']} packed matmuls, {_size(floats)} float -> "
                                f"{_size(packed)} packed ({bits:.3f} bits/weight), {meta.get('activations', 'fp32')} "
                                f"activations"))
        if meta.get("prequantized_matmuls"):
            rows.append(("from the model", f"{meta['prequantized_matmuls']} ({meta.get('prequantized', '')})"))
        if meta.get("combined_matmuls"):
            rows.append(("combined", _combined(meta["combined_matmuls"])))
    else:
        rows.append(("weights", "float (--quant none)" if meta.get("format") == "none" else
                     f"format {meta.get('format', '?')}"))
    kv = meta.get("kv_step")
    if kv:
        rows.append(("generation", f"in-place KV cache ({kv['function']}): up to {kv['max_length']} tokens, "
                                   f"batch <= {kv['max_batch']}, attention length padded to {kv['pad']}"
                                   + (f", caches held in {kv['cache_dtype']}" if kv.get("cache_dtype") else "")))
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{k + ':':<{width}}{v}" for k, v in rows]
    layers = meta.get("layers") or []
    if layers:
        lines.append("layers:")
        lines.append(f"  {'format':<14}{'K x N':>14}{'bits/w':>9}{'count':>7}")
        for row in layers:
            shape = f"{row['k']} x {row['n']}"
            experts = f"  (each of {row['experts']} experts)" if row.get("experts") else ""
            lines.append(f"  {row['format']:<14}{shape:>14}{row['bits_per_weight']:>9.3f}{row['count']:>7}{experts}")
    other = {k: v for k, v in meta.items() if k not in _KNOWN and k not in GPU_ARCH_KEYS}
    for key, value in other.items():
        lines.append(f"{key + ':':<{width}}{value if isinstance(value, str) else json.dumps(value)}")
    return "\n".join(lines)
