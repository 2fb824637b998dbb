"""Shared by the deploy tests: the cross tools they need, and one aarch64 artefact.

A missing tool skips the test on a developer's machine and fails it in CI (CI=true),
where .ci/run installs g++-aarch64-linux-gnu, qemu-user and binutils.
"""
from __future__ import annotations

import os
import shutil

import pytest

AARCH64 = "llvm -mtriple=aarch64-linux-gnu -mattr=+neon"
CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"


def require_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} not installed (apt-get install {package})"
        if os.environ.get("CI"):
            pytest.fail(message + ": .ci/run installs it")
        pytest.skip(message)
    return path
