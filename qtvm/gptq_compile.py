"""``qtvm compile --quant gptq:<uniform preset> --calib FILE``: GPTQ as a compile option.

The model's float MatMul/Gemm weight initializers (``qtvm.report.constant_weights``: the rule the
reference and the quantize report use) are GPTQ-quantized
(``qtvm.formats.gptq.gptq_quantize``) on calibration activations: each layer's
input, collected from one onnxruntime run of the float model on the calibration
inputs (``qtvm.report.collect_layer_inputs``). The results are written as a GPTQ
checkpoint (AutoGPTQ layout, one layer per weight initializer, named after it) and
compiled exactly as ``--gptq CKPT`` is: the same repacking and kernels, so a layer's
codes are the GPTQ codes and nothing is quantized twice (the temporary checkpoint keeps
float32 scales and zero points as they are: ``gptq_v2``). A weight read through a Transpose
(a dynamo export's tied lm_head) is a layer too (``GptqCheckpoint.apply`` follows the
Transpose to the initializer); a Constant node's weight has no initializer name a layer could
match: it is quantized by the preset, as any float weight the checkpoint leaves.

Calibration file: ``.npz`` with one array per model input (by name), or ``.npy`` for
a model with one input. Every position of every row is a calibration sample.
"""
from __future__ import annotations

import os
from pathlib import Path

from qtvm.errors import QtvmError

PREFIX = "gptq:"


def is_gptq_preset(quant: str) -> bool:
    return isinstance(quant, str) and quant.startswith(PREFIX)


def base_format(quant: str):
    """The uniform preset a ``gptq:`` name quantizes to (a QuantFormat)."""
    from qtvm.formats import get_format
    from qtvm.formats.uniform import UniformFormat

    base = quant.removeprefix(PREFIX)
    fmt = get_format(base)
    if not isinstance(fmt, UniformFormat):
        raise QtvmError(f"'{quant}': GPTQ quantizes to uniform formats only, not {base}",
                        "use gptq:<intB-gG>, e.g. gptq:int4-g128")
    return fmt


def load_calibration(path, model) -> dict:
    """{input name: array} from a .npz (by name) or .npy (single-input model); checked."""
    import numpy as np

    from qtvm.report import graph_inputs, prepare_inputs

    path = Path(path)
    if not path.is_file():
        raise QtvmError(f"calibration file '{path}' does not exist", "pass --calib FILE.npz (or .npy)")
    names = [v.name for v in graph_inputs(model)]
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                calib = {k: z[k] for k in z.files}
        elif path.suffix == ".npy":
            if len(names) != 1:
                raise QtvmError(f"calibration file '{path}' is one array but the model has {len(names)} inputs "
                                f"({', '.join(names)})", "pass a .npz with one array per input name")
            calib = {names[0]: np.load(path, allow_pickle=False)}
        else:
            raise QtvmError(f"calibration file '{path}' is not .npz or .npy", "save it with numpy.savez")
    except (OSError, ValueError) as e:
        raise QtvmError(f"calibration file '{path}' is unreadable ({type(e).__name__})",
                        "write it with numpy.save / numpy.savez") from None
    feeds, _ = prepare_inputs(model, calib)
    return feeds


def write_calibrated_checkpoint(model, quant: str, calib_path, out_path) -> list[str]:
    """GPTQ-quantize every constant float weight of ``model`` for ``quant`` on the
    activations ``calib_path`` produces; write the checkpoint to ``out_path``. Returns notes."""
    import numpy as np

    from qtvm.formats.gptq import gptq_quantize
    from qtvm.formats.gptq_checkpoint import write_autogptq
    from qtvm.report import _kn, _what, collect_layer_inputs, constant_weights

    fmt = base_format(quant)
    feeds = load_calibration(calib_path, model)
    # a checkpoint names initializers (read as B, or through a Transpose: a tied lm_head); a Constant
    # node's weight is left to the preset
    inits = {t.name for t in model.graph.initializer}
    weights = [w for w in constant_weights(model) if w.init_name in inits]
    _, acts = collect_layer_inputs(model, feeds, weights)
    layers = {}
    for w in weights:
        x = acts.get(w.init_name)
        if x is None or len(x) == 0:
            raise QtvmError(f"no calibration activations reach {_what(w)}", "pass inputs that reach every layer")
        # named as a GPTQ checkpoint names a layer (its weight's name without ".weight"), which
        # GptqCheckpoint.apply matches back to the initializer; the full name did not match
        prefix = w.init_name[:-len(".weight")] if w.init_name.endswith(".weight") else w.init_name
        layers[prefix] = gptq_quantize(_kn(w), x, fmt, name=_what(w))
    write_autogptq(out_path, layers, "gptq_v2", scale_dtype=np.float32)  # zero points as is, scales exact
    samples = sorted({len(a) for a in acts.values()})
    return [f"GPTQ ({fmt.name}) on {len(layers)} weights, calibrated on {samples[0]}"
            f"{'-' + str(samples[-1]) if len(samples) > 1 else ''} activation rows from '{calib_path}'"]


class CalibratedCheckpoint:
    """A temporary checkpoint for one compile (removed on exit)."""

    def __init__(self, model_path, quant: str, calib_path, binds: dict[str, str] | None = None):
        from qtvm.frontend.bind import bind_inputs
        from qtvm.frontend.onnx import load_onnx

        self.model = load_onnx(model_path)
        bind_inputs(self.model, binds or {})  # the graph the compile quantizes (a merged decoder's branch)
        self.quant, self.calib_path = quant, calib_path
        self.path: Path | None = None
        self.notes: list[str] = []

    def __enter__(self) -> "CalibratedCheckpoint":
        import tempfile

        fd, name = tempfile.mkstemp(prefix="qtvm-gptq-", suffix=".safetensors")
        os.close(fd)
        self.path = Path(name)
        try:
            self.notes = write_calibrated_checkpoint(self.model, self.quant, self.calib_path, self.path)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
