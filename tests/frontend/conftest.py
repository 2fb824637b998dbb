"""Session fixtures: transformers models exported once per session, compiled once per format."""
from __future__ import annotations

import os
import pathlib

import pytest


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    """Where exports go: QTVM_TEST_EXPORTS (kept between sessions) or a session temp dir."""
    kept = os.environ.get("QTVM_TEST_EXPORTS")
    return pathlib.Path(kept) if kept else tmp_path_factory.mktemp("hf_exports")


@pytest.fixture(scope="session")
def hf_model(hf_dir):
    """hf_model(family, exporter, kv=False) -> ONNX path, exported once per session."""
    from tests.frontend.transformers_exports import cached_export

    return lambda family, exporter, kv=False, mask=True: cached_export(hf_dir, family, exporter, kv, mask)


@pytest.fixture(scope="session")
def hf_compiled(hf_model, tmp_path_factory):
    """hf_compiled(family, exporter, quant, kv=False) -> CompileResult, compiled once per session."""
    from qtvm.pipeline import compile_model

    done = {}
    out_dir = tmp_path_factory.mktemp("hf_artefacts")

    def get(family, exporter, quant, kv=False):
        key = (family, exporter, quant, kv)
        if key not in done:
            path = hf_model(family, exporter, kv)
            done[key] = compile_model(path, out_dir / f"{'_'.join(map(str, key))}.so", "host", quant)
        return done[key]
    return get
