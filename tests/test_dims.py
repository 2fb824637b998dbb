"""Dimension names and expressions (dim_param) for the compiler and the runtime."""
from __future__ import annotations

from qtvm import dims


def test_plain_and_opaque_names():
    assert dims.parse("seq") is None and dims.symbols("seq") == ["seq"]
    # Not an expression: one symbol, whatever characters it has.
    for name in ("past_key_values.0.key_dim_2", "unk__0", "batch size", "s-"):
        assert dims.symbols(name) == [name]
        assert dims.evaluate(name, {name: 7}) == 7


def test_expressions_with_precedence():
    assert dims.symbols("past + seq") == ["past", "seq"]
    assert dims.evaluate("past + seq", {"past": 3, "seq": 4}) == 7
    assert dims.evaluate("past + seq * 2", {"past": 3, "seq": 4}) == 11  # not (3 + 4) * 2
    assert dims.evaluate("(past + seq) // 2", {"past": 3, "seq": 4}) == 3
    assert dims.evaluate("past_sequence_length + 1", {"past_sequence_length": 9}) == 10
    assert dims.evaluate("past + seq", {"seq": 4}) is None  # past unknown


def test_symbols_made_on_demand():
    made = {}
    assert dims.evaluate("a * b", made, make_symbol=lambda n: {"a": 2, "b": 5}[n]) == 10
    assert made == {"a": 2, "b": 5}


def test_not_expressions():
    for text in ("f(x)", "a ** 2", "a.b + 1", "1.5 * a", "a if b else c"):
        assert dims.parse(text) is None, text
