"""Instruction counts of a kernel's hot loop, read from its assembly.

A compute ceiling measured in seconds is noisy on a shared machine; the number of
instructions the innermost loop issues per 32-weight block is not. ``hot_loop``
finds the innermost loop (a label and the backward branch to it) holding the most
dot instructions; ``block_mix`` divides its instruction mix by the blocks one pass
of that loop handles (one block = 32 weights of one vector of columns).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

UNITS_PER_BLOCK = 8  # dot instructions (vpdpbusd / vpmaddubsw: qtvm.intrin.x86.ISA_DOT) per block

_LABEL = re.compile(r"^(\.L[\w$.]+):")
_BRANCH = re.compile(r"^\s+j\w+\s+(\.L[\w$.]+)\s*$")


def _instructions(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        text = line.split("#", 1)[0].strip()
        if text.startswith("{vex}"):  # AVX-VNNI's VEX form of an EVEX mnemonic
            text = text[len("{vex}"):].strip()
        if text and not text.startswith(".") and not text.endswith(":"):
            out.append(text)
    return out


def loops(asm: str) -> list[list[str]]:
    """Bodies (instruction lines) of every loop: a label up to a later branch back to it."""
    lines = asm.splitlines()
    where = {}
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            where[m.group(1)] = i
    bodies = []
    for i, line in enumerate(lines):
        m = _BRANCH.match(line)
        if m and m.group(1) in where and where[m.group(1)] < i:
            bodies.append(_instructions(lines[where[m.group(1)] + 1:i + 1]))
    return bodies


def hot_loop(asm: str, marker: str) -> list[str]:
    """The innermost loop with the most ``marker`` instructions (ties: the shortest)."""
    best = None
    for body in loops(asm):
        n = sum(1 for ins in body if ins.split()[0] == marker)
        if n and (best is None or (n, -len(body)) > best[0]):
            best = ((n, -len(body)), body)
    if best is None:
        raise ValueError(f"no loop with {marker} in the assembly")
    return best[1]


@dataclass(frozen=True)
class BlockMix:
    """What one pass of the hot loop issues, and per 32-value block of one column vector."""

    blocks: float  # 32-value blocks x column vectors per pass (dots / 8)
    total: int  # instructions per pass
    mix: dict  # mnemonic -> count per pass

    @property
    def per_block(self) -> float:
        return self.total / self.blocks

    def count(self, *prefixes: str) -> float:
        """Instructions per block whose mnemonic starts with any of ``prefixes``."""
        return sum(n for op, n in self.mix.items() if op.startswith(prefixes)) / self.blocks


def block_mix(asm: str, isa: str) -> BlockMix:
    from qtvm.intrin.x86 import ISA_DOT

    marker = ISA_DOT[isa]
    body = hot_loop(asm, marker)
    mix = Counter(ins.split()[0] for ins in body)
    return BlockMix(mix[marker] / UNITS_PER_BLOCK, len(body), dict(mix))
