"""Read and write .safetensors files with numpy only (no torch, no extra package).

The format (public spec of the ``safetensors`` project): an 8-byte little-endian
header length, a JSON header mapping each tensor name to ``dtype``, ``shape`` and
``[begin, end)`` byte offsets into the data that follows (plus an optional
``__metadata__`` map of strings), then the raw little-endian data.
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import numpy as np

from qtvm.atomic import atomic_file
from qtvm.errors import QtvmError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def read_header(path: str | os.PathLike, hint: str = "re-create the file") -> tuple[dict, memoryview]:
    """(JSON header, data bytes) of a safetensors file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise QtvmError(f"safetensors file '{path}' does not exist", "check the path")
    data = path.read_bytes()
    if len(data) < 8:
        raise QtvmError(f"'{path}' is too short to be a safetensors file", hint)
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise QtvmError(f"'{path}' has a bad safetensors header length ({n})", hint)
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        raise QtvmError(f"'{path}' has an unreadable safetensors header", hint) from None
    if not isinstance(header, dict):
        raise QtvmError(f"'{path}' has an unreadable safetensors header", hint)
    return header, memoryview(data)[8 + n:]


def load_safetensors(path: str | os.PathLike, hint: str = "reinstall the weights package") -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as a numpy array (copied out of the file)."""
    header, body = read_header(path, hint)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise QtvmError(f"tensor '{name}' in '{path}' has unsupported dtype {info.get('dtype')}",
                            f"supported: {', '.join(DTYPES)}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = math.prod(shape)
        if end - begin != count * np.dtype(dtype).itemsize or end > len(body):
            raise QtvmError(f"tensor '{name}' in '{path}' has offsets [{begin}, {end}) that do not match its "
                            f"shape {list(shape)}", hint)
        arr = np.frombuffer(body[begin:end], dtype=np.dtype(dtype).newbyteorder("<"), count=count)
        out[name] = arr.astype(np.dtype(dtype), copy=True).reshape(shape)
    return out


def load_metadata(path: str | os.PathLike, hint: str = "re-create the file") -> dict[str, str]:
    header, _ = read_header(path, hint)
    meta = header.get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def save_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                     metadata: dict[str, str] | None = None) -> pathlib.Path:
    """Write ``tensors`` atomically (temp file + rename): ``path`` is complete or untouched."""
    path = pathlib.Path(path)
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}}
    blobs, offset = [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in _NAMES:
            raise QtvmError(f"tensor '{name}' has dtype {a.dtype}, which safetensors cannot store here",
                            f"use one of {', '.join(str(np.dtype(d)) for d in DTYPES.values())}")
        raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with atomic_file(path) as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    return path
