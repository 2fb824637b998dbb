"""Shared by the bundled models: atomic legacy-exporter ONNX files and their cache."""
from __future__ import annotations

import os
import pathlib
import tempfile
import warnings


def export_torch_onnx(model, example: tuple, path: str | os.PathLike, **export_kwargs) -> pathlib.Path:
    """torch.onnx.export (legacy TorchScript exporter, opset 17) to a temp file, then rename.

    The legacy exporter is chosen on purpose: its graphs import into TVM's Relax
    frontend with symbolic dims, and constant folding turns each Linear's
    transposed weight into a plain initializer feeding MatMul (what the
    quantizer looks for).
    """
    import torch

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(model, example, tmp, dynamo=False, opset_version=17, do_constant_folding=True,
                              **export_kwargs)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def cache_dir() -> pathlib.Path:
    """QTVM_CACHE_DIR, or ~/.cache/qtvm."""
    cache = os.environ.get("QTVM_CACHE_DIR")
    return pathlib.Path(cache) if cache else pathlib.Path.home() / ".cache" / "qtvm"


def cached(name: str, export) -> pathlib.Path:
    """The cached file ``name``, exported with ``export(path)`` on first use."""
    path = cache_dir() / name
    if not path.exists():
        export(path)
    return path
