"""Keep TVM's own chatter off the user's terminal.

TVM's C++ side logs warnings straight to file descriptor 2 (``LOG(WARNING)``: arithmetic
notes, builder-state warnings), and its Python side uses ``warnings`` and ``print``.
None of it is addressed to a qtvm user, whose terminal shows qtvm's own lines only.
:func:`tvm_output_captured` diverts all three for the duration of a compile; with
``QTVM_DEBUG`` set nothing is diverted, for whoever debugs qtvm itself.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import warnings


@contextlib.contextmanager
def tvm_output_captured():
    """Divert native stderr, Python warnings and stray prints; yields a function returning
    what was captured (for a caller that wants to show it after all)."""
    if os.environ.get("QTVM_DEBUG"):
        yield lambda: ""
        return
    sys.stderr.flush()
    saved = os.dup(2)
    sink = tempfile.TemporaryFile(mode="w+b")
    printed = io.StringIO()
    # qtvm's own Python-level output (progress bars, -v logging) keeps the real stderr:
    # only file descriptor 2, where TVM's C++ logs, goes to the sink.
    own_stderr, real = sys.stderr, os.fdopen(os.dup(saved), "w", buffering=1, errors="replace")
    os.dup2(sink.fileno(), 2)
    sys.stderr = real
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            warnings.simplefilter("ignore")
            yield lambda: _read(sink) + printed.getvalue()
    finally:
        real.flush()
        sys.stderr = own_stderr
        real.close()
        os.dup2(saved, 2)
        os.close(saved)
        sink.close()


def _read(sink) -> str:
    sink.seek(0)
    return sink.read().decode(errors="replace")
