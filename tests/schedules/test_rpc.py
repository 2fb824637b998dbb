"""Tuning through TVM's RPC tracker: a tracker and two servers on the loopback.

The wheel's runtime has no OpenCL, so the servers measure llvm builds of the kernels
(on a phone, TVM's RPC app measures OpenCL the same way).  Fault cases: unreachable
tracker, a key with no server, a server killed mid-tuning, an interrupted run that
resumes.  Every process is started in its own session and killed by its group at the
end; ports are picked free; every wait is bounded.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import onnx
import pytest

from qtvm.cli import main
from qtvm.errors import QtvmError
from qtvm.pipeline import build_module
from qtvm.target import parse_target
from schedules import rpc, tune
from tests.conftest import TUNING_WORKER, matmul_model
from tests.schedules.test_tune import _check_numerics, _kernel

pytestmark = TUNING_WORKER  # tests/conftest.py

KEY = "qtvm-test"
K, N = 256, 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    finally:
        out.close()


def _kill(proc: subprocess.Popen) -> None:
    """The process and everything it forked (its own session), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _wait(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")


class Cluster:
    """A tracker and ``n`` servers under KEY on 127.0.0.1."""

    def __init__(self, folder: Path, n: int) -> None:
        self.folder, self.procs, self.servers = folder, [], {}
        self.port = _free_port()
        self.tracker = rpc.Tracker("127.0.0.1", self.port, KEY, wait_s=3.0)
        self.procs.append(_spawn(["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(self.port),
                                  "--port-end", str(self.port + 1), "--silent"], folder / "tracker.log"))

        def up():
            with contextlib.suppress(QtvmError):
                return rpc.summary(self.tracker) is not None
        _wait(up, 60, "the tracker")
        for i in range(n):
            self.add_server(i)
        _wait(lambda: len(rpc.servers(rpc.summary(self.tracker), KEY)) == n, 60, f"{n} servers")

    def add_server(self, i: int) -> None:
        port = _free_port()
        proc = _spawn(["tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{self.port}", "--key", KEY,
                       "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)],
                      self.folder / f"server{i}.log")
        self.procs.append(proc)
        self.servers[f"127.0.0.1:{port}"] = proc

    def loads(self) -> dict[str, int]:
        """Modules each server loaded (its log says so per measurement)."""
        return {f"server{i}": (self.folder / f"server{i}.log").read_text(errors="replace").count("load_module")
                for i in range(len(self.servers))}

    def close(self) -> None:
        for proc in self.procs:
            _kill(proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("rpc"), 2)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m, w = matmul_model(K, N)
    path = tmp_path_factory.mktemp("model") / "mm.onnx"
    onnx.save(m, str(path))
    return path, w


def _tune_cli(model_path, db, *extra, trials=4):
    return ["tune", str(model_path), "--target", "host", "--trials", str(trials), "--db", str(db), "--quant",
            "int4-g128", *extra]


def _records(db_dir: Path) -> list[dict]:
    lines = (db_dir / "database_tuning_record.json").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# ---------------------------------------------------------------- bad input, fast


def test_unreachable_tracker_fails_before_any_work(model, tmp_path, capsys):
    closed = _free_port()  # nothing listens there
    start = time.monotonic()
    assert main(_tune_cli(model[0], tmp_path / "db", "--rpc", f"127.0.0.1:{closed}", "--device-key", KEY)) == 2
    assert time.monotonic() - start < 15
    err = capsys.readouterr().err
    assert f"RPC tracker 127.0.0.1:{closed} is not reachable (connection refused)" in err
    assert "tvm.exec.rpc_tracker" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "db").exists()

    with socket.socket() as other:  # something that is not a tracker
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        stop = threading.Event()

        def answer():
            other.settimeout(0.2)
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    conn, _ = other.accept()
                    with conn:
                        conn.recv(4)
                        conn.sendall(b"HTTP")
        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        try:
            assert main(_tune_cli(model[0], tmp_path / "db", "--rpc", f"127.0.0.1:{port}", "--device-key", KEY)) == 2
        finally:
            stop.set()
            thread.join(5)
        assert "is not a TVM RPC tracker" in capsys.readouterr().err

    for bad in (["--rpc", "nohost", "--device-key", KEY], ["--rpc", "127.0.0.1:9190"], ["--device-key", KEY],
                ["--rpc", "127.0.0.1:9190", "--device-key", KEY, "--rpc-wait", "0"]):
        assert main(_tune_cli(model[0], tmp_path / "db", *bad)) == 2
        assert capsys.readouterr().err.startswith("qtvm: error:")


def test_key_without_servers_fails_after_the_wait(cluster, model, tmp_path, capsys):
    start = time.monotonic()
    code = main(_tune_cli(model[0], tmp_path / "db", "--rpc", cluster.tracker.address, "--device-key", "no-such-key",
                          "--rpc-wait", "2"))
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2 and 2 <= took < 20, (took, err)
    assert "no RPC server under key 'no-such-key'" in err and f"keys registered there: {KEY}" in err
    assert "--key no-such-key" in err  # how to start one
    assert not (tmp_path / "db").exists()


def test_target_device_must_exist_on_the_servers(cluster):
    """An OpenCL target on servers whose runtime has no OpenCL: said before tuning."""
    with pytest.raises(QtvmError, match="has no opencl device"):
        rpc.describe_device(cluster.tracker, "opencl")
    assert rpc.describe_device(cluster.tracker, "cpu") == f"rpc key {KEY}: cpu"


# ----------------------------------------------------------------------- tuning


def test_tuning_on_two_servers(cluster, model, tmp_path):
    path, w = model
    target = parse_target("host")
    mod, *_ = build_module(path, target, "int4-g128")
    before = cluster.loads()
    report = tune.tune_kernels(mod, target, tmp_path / "db", 4, progress=False, seed=0,
                               rpc=rpc.Tracker("127.0.0.1", cluster.port, KEY, wait_s=30.0))
    assert report.device == f"rpc key {KEY}: cpu"
    row = report.kernels[0]
    assert row.analytic_s and row.tuned_s and report.measured == 4
    after = cluster.loads()
    assert all(after[s] > before[s] for s in after), (before, after)  # both servers measured
    records = _records(tmp_path / "db")
    assert records and all(r[1][2]["model"] == f"rpc key {KEY}: cpu" for r in records)  # device in every record
    new, notes = tune.apply_database(mod, target, tmp_path / "db")
    assert notes and _kernel(mod)[0].name_hint in notes[0]
    _check_numerics(new, target, w)


def test_measurement_retried_when_its_server_is_lost(monkeypatch):
    """The retry decision alone, with scripted worker results: a connection error from a
    server the tracker no longer lists is measured again elsewhere and said."""
    import concurrent.futures

    script = [("error", "127.0.0.1:1", "TVMError: Socket closed by peer"), ("ok", "127.0.0.1:2", [1e-6, 2e-6])]
    said = []

    class Runner:
        job_timeout = 5.0
        health = rpc._Health(rpc.Tracker("127.0.0.1", 1, KEY), said.append, {"127.0.0.1:1", "127.0.0.1:2"})

        def submit(self, job):
            fut = concurrent.futures.Future()
            fut.set_result(script.pop(0))
            return fut

    monkeypatch.setattr(rpc._Health, "current", lambda self: ["127.0.0.1:2"])
    result = rpc._TrackerFuture(Runner(), ("a.so", "cpu", (), None)).result()
    assert result.error_msg is None and [float(s) for s in result.run_secs] == pytest.approx([1e-6, 2e-6])
    assert len(said) == 1 and "RPC server 127.0.0.1:1" in said[0] and "lost" in said[0]

    script[:] = [("error", "127.0.0.1:2", "ValueError: bad kernel")]  # the kernel's own failure: no retry
    result = rpc._TrackerFuture(Runner(), ("a.so", "cpu", (), None)).result()
    assert "bad kernel" in result.error_msg and script == []

    script[:] = [("no-server", None, "no RPC server under key became free")]
    with pytest.raises(Exception, match="no RPC server under key became free"):  # (through the FFI: RuntimeError)
        rpc._TrackerFuture(Runner(), ("a.so", "cpu", (), None)).result()
    assert Runner.health.fatal.startswith("no RPC server")  # what tune_kernels reports


def test_server_killed_mid_tuning(model, tmp_path):
    """Kill one of two servers once the first record is in: the run finishes on the
    other, says which server it lost, and records no candidate as failed for it."""
    (tmp_path / "cluster").mkdir()
    c = Cluster(tmp_path / "cluster", 2)
    try:
        db = tmp_path / "db"
        proc = subprocess.Popen([sys.executable, "-m", "qtvm.cli", *_tune_cli(model[0], db, "--rpc",
                                 c.tracker.address, "--device-key", KEY, "--rpc-wait", "20", trials=4)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.getcwd()}, start_new_session=True)
        try:
            _wait(lambda: (db / "database_tuning_record.json").is_file() and _records(db), 240, "the first record")
            victim, victim_proc = next(iter(c.servers.items()))
            _kill(victim_proc)
            out, err = proc.communicate(timeout=400)
        finally:
            _kill(proc)
        assert proc.returncode == 0, err[-2000:]
        assert f"RPC server {victim}" in err + out and ("lost" in err + out or "left the tracker" in err + out)
        records = _records(db)
        assert all(max(float(s) for s in r[1][1]) < 1.0 for r in records)  # no 1e10 "failed" timings
        seen = {json.dumps(tune.trace_knobs(rec.trace), sort_keys=True) for rec in
                tune.open_database(db, create=False).get_all_tuning_records()}
        # analytic + every trial measured: 5 records at least; a mutation can reach an earlier knob
        # setting by another trace, so the distinct settings may be one fewer
        assert (len(records) >= 1 + 4 and len(seen) >= 4) or "ran out" in out
    finally:
        c.close()


FAKE_SERVER = """
import json, socket, struct, sys

tracker_port, key = int(sys.argv[1]), sys.argv[2]
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
port = srv.getsockname()[1]
t = socket.create_connection(("127.0.0.1", tracker_port))
t.sendall(struct.pack("<i", 0x2F271))
t.recv(4)
def call(value):
    data = json.dumps(value).encode()
    t.sendall(struct.pack("<i", len(data)) + data)
    size = struct.unpack("<i", t.recv(4))[0]
    return t.recv(size)
call([5, {"key": "server:" + key, "addr": [None, port]}])
call([3, key, [port, key + ":fake"], None])
conn, _ = srv.accept()  # a measurement arrives: the device dies
conn.close(); t.close(); srv.close()
"""


def test_server_dying_during_a_measurement(model, tmp_path):
    """A server that registers, then dies when a measurement reaches it: that measurement
    is repeated on the other server, the run names the lost server, no failure is recorded."""
    (tmp_path / "cluster").mkdir()
    c = Cluster(tmp_path / "cluster", 1)
    fake = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(c.port), KEY], start_new_session=True)
    c.procs.append(fake)
    try:
        _wait(lambda: len(rpc.servers(rpc.summary(c.tracker), KEY)) == 2, 60, "the dying server")
        fake_addr = next(a for a in rpc.servers(rpc.summary(c.tracker), KEY) if a not in c.servers)
        target = parse_target("host")
        mod, *_ = build_module(model[0], target, "int4-g128")
        report = tune.tune_kernels(mod, target, tmp_path / "db", 4, progress=False, seed=0,
                                   rpc=rpc.Tracker("127.0.0.1", c.port, KEY, wait_s=20.0))
        assert fake.wait(timeout=30) == 0  # it was reached, and died
        lost = [n for n in report.notes if f"RPC server {fake_addr}" in n]
        assert lost and "lost during a measurement" in lost[0], report.notes
        assert report.measured == 4
        assert all(max(float(s) for s in r[1][1]) < 1.0 for r in _records(tmp_path / "db"))
    finally:
        c.close()


def test_interrupted_tuning_keeps_records_and_resumes(cluster, model, tmp_path):
    db = tmp_path / "db"
    cmd = [sys.executable, "-m", "qtvm.cli", *_tune_cli(model[0], db, "--rpc", cluster.tracker.address,
                                                          "--device-key", KEY, trials=40)]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        # The analytic seed, then the first batch of tuned candidates, then interrupt.
        _wait(lambda: (db / "database_tuning_record.json").is_file() and len(_records(db)) >= 3, 300,
              "the first tuned records")
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        _kill(proc)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "record(s) kept" in err and "rerun the same command to resume" in err
    kept = _records(db)
    assert len(kept) >= 3
    target = parse_target("host")
    mod, *_ = build_module(model[0], target, "int4-g128")
    tasks = tune._collect(mod, target, [])
    dbo = tune.open_database(db, create=False)
    before = sum(tune._measured_before(dbo, tasks, target).values())
    assert before >= 1
    del dbo

    proc = subprocess.run([*cmd[:cmd.index("--trials") + 1], str(before + 2), *cmd[cmd.index("--trials") + 2:]],
                          capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resuming: {before} of {before + 2} trials already in the database, 2 to measure" in proc.stderr
    after = _records(db)
    assert after[:len(kept)] == kept  # every earlier record kept as it was
    dbo = tune.open_database(db, create=False)
    # Two more trials measured (counted below); MetaSchedule's mutations can land on knob
    # settings an earlier run measured through a different trace (the space is small; a CI run's
    # first pass had measured 8 distinct settings), so distinct settings grow by 0-2.
    assert before <= sum(tune._measured_before(dbo, tasks, target).values()) <= before + 2
    # New in the second run: the 2 missing trials and the final confirmation of the analytic
    # and the best tuned schedule (2 rounds x 5 timings each); the analytic schedule, measured
    # by the first run, is not seeded again.
    new = after[len(kept):]
    assert sum(len(r[1][1]) == 10 for r in new) == 2 and len(new) == 2 + 2, [len(r[1][1]) for r in new]


def test_candidates_for_an_aarch64_device_are_cross_linked(model, tmp_path):
    """What an aarch64 board's RPC server would load: a shared library linked by the
    cross toolchain (here checked with readelf; no aarch64 server runs here)."""
    from qtvm.deploy import elf, toolchain
    from tests.deploy.cross import AARCH64, CXX, require_tool

    require_tool(CXX, "g++-aarch64-linux-gnu")
    target = parse_target(AARCH64)
    mod, *_ = build_module(model[0], target, "int4-g128")
    _gv, func = _kernel(mod)
    compute, why = tune.unscheduled_kernel(func, target)
    assert compute is not None, why
    space = tune.KnobSpace.of(compute, target)
    sch = space.schedule(tune.workload_of(compute)["main"], space.analytic)
    builder = tune.make_builder(toolchain.toolchain_for(target), shared=True)
    (result,) = builder.build([tune.ms.builder.BuilderInput(sch.mod, target)])
    assert result.error_msg is None, result.error_msg
    assert result.artifact_path.endswith(".so")
    info = elf.read_elf(result.artifact_path)
    assert info.machine == "AArch64" and "main" in info.kernels
