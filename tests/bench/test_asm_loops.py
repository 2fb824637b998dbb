from __future__ import annotations

import pytest

from qtvm.bench.asm_loops import block_mix, hot_loop, loops

ASM = """
f:
\tmovq\t%rdi, %rax
.LBB0_1:
\tvmovdqa64\t(%rax), %zmm1
.LBB0_2:
\tvpandq\t%zmm0, %zmm1, %zmm2
\tvpdpbusd\t%zmm3, %zmm2, %zmm4
\tvpdpbusd\t%zmm3, %zmm2, %zmm5
\t{vex}\tvpdpbusd\t%ymm3, %ymm2, %ymm5
\taddq\t$64, %rax   # comment
\tcmpq\t%rcx, %rax
\tjne\t.LBB0_2
\tvcvtdq2ps\t%zmm4, %zmm4
\tjne\t.LBB0_1
\tretq
"""


def test_loops_are_label_to_backward_branch():
    bodies = loops(ASM)
    assert len(bodies) == 2
    assert [ins.split()[0] for ins in bodies[0]] == ["vpandq", "vpdpbusd", "vpdpbusd", "vpdpbusd", "addq", "cmpq",
                                                    "jne"]


def test_hot_loop_is_the_innermost_with_most_dots():
    assert len(hot_loop(ASM, "vpdpbusd")) == 7  # the inner loop: as many dots, fewer instructions
    with pytest.raises(ValueError):
        hot_loop(ASM, "vpmaddubsw")


def test_block_mix_counts_per_block():
    m = block_mix(ASM, "avx512vnni")
    assert m.blocks == 3 / 8 and m.total == 7
    assert m.count("vpdpbusd") == 8 and m.count("vpand") == 8 / 3
