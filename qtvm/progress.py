"""Progress bars for long work (compiles, tuning, benchmarks), and the CLI's verbosity.

Bars are drawn only for a person watching: on stderr when it is a terminal and the
user did not ask for quiet (``qtvm -q``, or ``QTVM_PROGRESS=0``); logs, pipes and CI
get none.  ``QTVM_PROGRESS=1`` forces them on (tests of the bar itself).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager

_quiet = False
LOGGERS = ("qtvm", "schedules", "relay_passes")  # the project's packages log under their module names
_LOG = logging.getLogger("qtvm.progress")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (a compile points it at
    the real terminal while TVM's own output is diverted: ``qtvm.quiet``)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def configure(verbosity: int) -> None:
    """The CLI's -v/-q: -q (< 0) silences bars and info; -v shows info, -vv debug."""
    global _quiet
    _quiet = verbosity < 0
    level = logging.DEBUG if verbosity >= 2 else logging.INFO if verbosity == 1 else logging.WARNING
    if verbosity < 0:
        level = logging.ERROR
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not logger.handlers:
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("qtvm: %(levelname)s: %(message)s"))
            logger.addHandler(handler)
        logger.propagate = False


def quiet() -> bool:
    return _quiet


def bars_enabled(stream=None) -> bool:
    forced = os.environ.get("QTVM_PROGRESS")
    if _quiet or forced == "0":
        return False
    if forced == "1":
        return True
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class _NoBar:
    """What a bar is when bars are off: every call does nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_description_str(self, *_a, **_k) -> None:
        pass

    def set_postfix_str(self, *_a, **_k) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int | None, desc: str, unit: str = "it"):
    """A tqdm bar on stderr, or a do-nothing object when bars are off."""
    if not bars_enabled():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)


@contextmanager
def stages(names: list[str], desc: str):
    """A bar over named stages: ``with stages([...], "compile") as step: step("import") ...``;
    each call finishes the stage before it and names the one starting."""
    b = bar(len(names), desc, unit="stage")
    current: list = []  # [name, start time] of the running stage

    def finish() -> None:
        if current:
            b.update(1)
            _LOG.info("%s: %s took %.1f s", desc, current[0], time.perf_counter() - current[1])

    def step(name: str) -> None:
        finish()
        current[:] = [name, time.perf_counter()]
        b.set_postfix_str(name)

    try:
        yield step
        finish()
    finally:
        b.close()
