"""TVM's output diverted during a compile: native stderr, warnings, prints."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_native_stderr_warnings_and_prints_are_captured():
    script = textwrap.dedent("""
        import os, warnings
        from qtvm.quiet import tvm_output_captured
        with tvm_output_captured() as captured:
            os.write(2, b"native warning\\n")
            warnings.warn("python warning")
            print("stray print")
            text = captured()
        print("after:", "native warning" in text, "stray print" in text)
        os.write(2, b"visible again\\n")
    """)
    env = {k: v for k, v in os.environ.items() if k != "QTVM_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "after: True True\n"
    assert proc.stderr == "visible again\n"


def test_qtvm_debug_passes_everything_through():
    script = textwrap.dedent("""
        import os
        from qtvm.quiet import tvm_output_captured
        with tvm_output_captured():
            os.write(2, b"native warning\\n")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "QTVM_DEBUG": "1"})
    assert proc.stderr == "native warning\n"
