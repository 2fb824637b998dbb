"""The registry of named weight formats (presets are user-facing names)."""
from __future__ import annotations

from qtvm.errors import QtvmError
from qtvm.formats.base import QuantFormat, QuantizedTensor
from qtvm.formats.uniform import SCALE_DTYPES, VALID_BITS, VALID_GROUPS, UniformFormat

PRESETS: dict[str, QuantFormat] = {}


def register(fmt: QuantFormat) -> QuantFormat:
    PRESETS[fmt.name] = fmt
    return fmt


for _bits in VALID_BITS:
    for _g in (*VALID_GROUPS, None):
        for _scales in SCALE_DTYPES:
            register(UniformFormat(_bits, _g, _scales))

# Each format family registers its presets here, one import line per family module
# (the module calls ``register`` at import time).
# -- families --
from qtvm.formats import gptq as _gptq  # noqa: E402,F401  int*-qz presets
from qtvm.formats import mixed as _mixed  # noqa: E402,F401  mixed-2-4-16
from qtvm.formats import bcq as _bcq  # noqa: F401,E402
from qtvm.formats import e0m4 as _e0m4  # noqa: F401,E402


def get_format(name: str) -> QuantFormat:
    try:
        return PRESETS[name]
    except KeyError:
        raise QtvmError(f"unknown quant preset '{name}'",
                        "run `qtvm formats` for the list (e.g. int4-g128)") from None


__all__ = ["PRESETS", "QuantFormat", "QuantizedTensor", "UniformFormat", "get_format", "register"]
