"""Progress bars and -v/-q through the real CLI: a bar on a terminal (a pseudo-terminal here),
none in a pipe or under -q; -v logs each stage's time."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import onnx
import pytest

from qtvm import progress
from tests.conftest import mlp_model


def _env():
    env = dict(os.environ)
    env.pop("QTVM_PROGRESS", None)
    return env


def run_on_terminal(*args) -> tuple[int, str]:
    """Run the CLI with stdout and stderr on a pseudo-terminal; (exit code, everything it wrote)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 40 rows x 120 columns
    proc = subprocess.Popen([sys.executable, "-m", "qtvm.cli", *map(str, args)], stdout=slave, stderr=slave,
                            stdin=subprocess.DEVNULL, env=_env(), close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=300), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("progress")
    onnx.save(mlp_model(k=64, hidden=32, n=16), str(d / "mlp.onnx"))
    return d


def test_compile_shows_a_bar_on_a_terminal(model):
    rc, out = run_on_terminal("compile", model / "mlp.onnx", "-o", model / "a.so")
    assert rc == 0, out
    assert "qtvm compile:" in out and "3/3" in out and "stage" in out  # tqdm's bar, finished
    assert "import + quantize" in out and "export" in out
    assert "wrote " in out


def test_quiet_on_a_terminal(model):
    rc, out = run_on_terminal("compile", "-q", model / "mlp.onnx", "-o", model / "b.so")
    assert rc == 0 and "wrote " in out and "qtvm compile:" not in out, out


def test_no_bar_in_a_pipe_and_verbose_logs_stage_times(model):
    proc = subprocess.run([sys.executable, "-m", "qtvm.cli", "-v", "compile", str(model / "mlp.onnx"), "-o",
                           str(model / "c.so")], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert "%|" not in proc.stderr and "stage/s" not in proc.stderr, proc.stderr
    logged = [line for line in proc.stderr.splitlines() if line.startswith("qtvm: INFO: qtvm compile:")]
    assert [line.split(": ")[3].split(" took ")[0] for line in logged] == ["import + quantize", "schedule + build",
                                                                          "export"]


def test_bars_follow_the_stream_and_the_switches(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("QTVM_PROGRESS", raising=False)
    progress.configure(0)
    assert progress.bars_enabled(Tty()) and not progress.bars_enabled(open(os.devnull, "w"))
    monkeypatch.setenv("QTVM_PROGRESS", "0")
    assert not progress.bars_enabled(Tty())
    monkeypatch.setenv("QTVM_PROGRESS", "1")
    progress.configure(-1)  # -q wins over everything
    assert not progress.bars_enabled(Tty())
    progress.configure(0)
    assert progress.bars_enabled(open(os.devnull, "w"))
