"""Symbolic dimension names: ``batch``, ``seq``, and expressions of them such as ``past + seq``.

An ONNX ``dim_param`` may be a plain symbol or an integer expression of symbols
(``+ - * //``, parentheses, integer literals), which is how an export states that a
dimension is related to others (an attention mask over ``past + seq`` positions).
A name that is not such an expression (``unk__0``, ``past_key_values.0.key_dim_2``)
is one opaque symbol. Shared by the compiler (which turns these into TIR
expressions) and the thin runtime (which checks inputs against them), so nothing
here imports TVM.
"""
from __future__ import annotations

import ast
import operator
import re

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse(text: str):
    """The expression tree of ``text`` (an ``ast`` node), or None if it is one opaque symbol."""
    if _IDENT.match(text.strip()):
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        ok = (isinstance(node, (ast.BinOp, ast.Name, ast.Load, ast.UnaryOp, ast.USub, *_OPS))
              or isinstance(node, ast.Constant) and type(node.value) is int)
        if not ok:
            return None
    return tree


def symbols(text: str) -> list[str]:
    """The plain symbols ``text`` uses, in order of first use."""
    tree = parse(text)
    if tree is None:
        return [text]
    seen = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in seen:
            seen.append(node.id)
    return seen


def evaluate(text: str, bindings: dict, make_symbol=None):
    """``text`` with each symbol looked up in ``bindings``; a symbol missing from it is
    made by ``make_symbol(name)`` (and remembered) or, without one, makes the result None.
    Works on ints (the runtime) and TIR expressions (the compiler) alike."""
    def look(name):
        if name not in bindings:
            if make_symbol is None:
                return None
            bindings[name] = make_symbol(name)
        return bindings[name]

    tree = parse(text)
    if tree is None:
        return look(text)

    def ev(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return look(node.id)
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand)
            return None if v is None else -v
        a, b = ev(node.left), ev(node.right)
        return None if a is None or b is None else _OPS[type(node.op)](a, b)

    return ev(tree)
