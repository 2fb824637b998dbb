"""Measuring candidates on devices through TVM's RPC tracker (``qtvm tune --rpc``).

Devices run TVM's RPC server (``python -m tvm.exec.rpc_server --tracker HOST:PORT
--key KEY`` on a board; TVM's Android RPC app on a phone, which serves OpenCL) and
register with one tracker (``python -m tvm.exec.rpc_tracker``) under a key naming the
device kind.  :class:`TrackerRunner` is a MetaSchedule runner that measures a batch of
candidates on as many servers as are registered under the key, at once: each
measurement asks the tracker for a free server, uploads the candidate (a shared
library linked for the device, see ``qtvm.deploy.toolchain``), allocates random
arguments there and times the kernel.

Unlike MetaSchedule's ``RPCRunner``, every wait is bounded and a lost device is not a
slow kernel:

* the tracker is checked before any work (:func:`check_tracker`): unreachable, not a
  tracker, or no server under the key within ``wait_s`` -> one-line error;
* each measurement runs in a worker process killed after ``wait_s + timeout_s``;
* a measurement that fails because its server went away (connection error, or the
  server left the tracker) is measured again on another server and the run says which
  server was lost; MetaSchedule would otherwise record the candidate as failed;
* when no server is left, the run stops with an error after ``wait_s`` (the records
  measured so far stay in the database and a rerun resumes).
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from qtvm.errors import QtvmError

TRACKER_MAGIC = 0x2F271
CODE_SUCCESS, CODE_REQUEST, CODE_SUMMARY = 0, 4, 6
CONNECT_TIMEOUT_S = 5.0
MAX_ATTEMPTS = 3  # measurements of one candidate when its servers keep dropping out
_LOST_WORDS = ("socket", "connection", "connect", "closed", "broken pipe", "reset by peer", "eof", "timed out",
               "timeout", "rpc session", "cannot request")


@dataclass(frozen=True)
class Tracker:
    """Where the device servers are: tracker address, device key, bounds on waiting."""

    host: str
    port: int
    key: str
    wait_s: float = 30.0  # longest wait for a free server (before tuning and per measurement)
    timeout_s: float = 60.0  # longest measurement of one candidate once a server is assigned

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start_hint(self) -> str:
        return (f"start one on the device: python -m tvm.exec.rpc_server --tracker {self.address} --key {self.key} "
                "(or TVM's Android RPC app)")


def parse_tracker(text: str, key: str | None, wait_s: float = 30.0) -> Tracker:
    """``--rpc HOST:PORT --device-key KEY`` -> Tracker (QtvmError on bad input)."""
    if not key:
        raise QtvmError("--rpc needs --device-key", "give the key the device's RPC servers registered under")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise QtvmError(f"--rpc '{text}' is not HOST:PORT", "e.g. --rpc 127.0.0.1:9190")
    if not wait_s > 0:
        raise QtvmError(f"--rpc-wait must be a positive number of seconds, got {wait_s}")
    return Tracker(host.strip("[]"), int(port), key, float(wait_s))


# ------------------------------------------------------------------ tracker protocol


def _send(sock: socket.socket, value) -> None:
    import json

    data = json.dumps(value).encode()
    sock.sendall(struct.pack("<i", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("the tracker closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket):
    import json

    (size,) = struct.unpack("<i", _recv_exact(sock, 4))
    return json.loads(_recv_exact(sock, size).decode())


def _open(tracker: Tracker) -> socket.socket:
    """A tracker connection after the magic handshake (bounded by CONNECT_TIMEOUT_S)."""
    sock = socket.create_connection((tracker.host, tracker.port), timeout=CONNECT_TIMEOUT_S)
    try:
        sock.sendall(struct.pack("<i", TRACKER_MAGIC))
        (magic,) = struct.unpack("<i", _recv_exact(sock, 4))
        if magic != TRACKER_MAGIC:
            raise ConnectionError(f"{tracker.address} answered, but is not a TVM RPC tracker")
    except BaseException:
        sock.close()
        raise
    return sock


def summary(tracker: Tracker) -> dict:
    """The tracker's summary (servers and queues); QtvmError when it cannot be reached."""
    try:
        with _open(tracker) as sock:
            _send(sock, [CODE_SUMMARY])
            reply = _recv(sock)
    except (OSError, ValueError, struct.error) as e:
        why = "connection refused" if isinstance(e, ConnectionRefusedError) else \
            "no answer" if isinstance(e, socket.timeout) else str(e) or type(e).__name__
        raise QtvmError(f"RPC tracker {tracker.address} is not reachable ({why})",
                        f"start it with python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port {tracker.port}, "
                        "or check --rpc") from None
    if not isinstance(reply, list) or reply[0] != CODE_SUCCESS:
        raise QtvmError(f"RPC tracker {tracker.address} sent an unexpected reply to a summary request")
    return reply[1]


def servers(info: dict, key: str) -> list[str]:
    """Addresses ("host:port") of the servers registered under ``key``."""
    out = []
    for item in info.get("server_info", []):
        if str(item.get("key", "")).split(":", 1)[-1] == key:
            addr = item.get("addr") or ["?", "?"]
            out.append(f"{addr[0]}:{addr[1]}")
    return sorted(out)


def check_tracker(tracker: Tracker, log=None) -> list[str]:
    """The servers under the key, waiting at most ``wait_s`` for the first; QtvmError otherwise."""
    deadline = time.monotonic() + tracker.wait_s
    announced = False
    while True:
        info = summary(tracker)
        found = servers(info, tracker.key)
        if found:
            return found
        if time.monotonic() >= deadline:
            keys = sorted({str(i.get("key", "")).split(":", 1)[-1] for i in info.get("server_info", [])})
            there = f"keys registered there: {', '.join(keys)}" if keys else "no server is registered there"
            raise QtvmError(f"no RPC server under key '{tracker.key}' at tracker {tracker.address} after "
                            f"{tracker.wait_s:g} s ({there})", tracker.start_hint())
        if log is not None and not announced:
            log(f"waiting up to {tracker.wait_s:g} s for an RPC server under key '{tracker.key}'")
            announced = True
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


class NoServer(RuntimeError):
    """No server under the key became free within the wait."""


class ServerFailed(ConnectionError):
    """The server the tracker assigned failed; ``addr`` says which."""

    def __init__(self, addr: str, message: str) -> None:
        super().__init__(message)
        self.addr = addr


def request_session(tracker: Tracker, session_timeout: float):
    """(RPCSession, server address) from the tracker, waiting at most ``wait_s`` for a free server."""
    from tvm import rpc

    sock = _open(tracker)
    try:
        _send(sock, [CODE_REQUEST, tracker.key, "", 1])
        sock.settimeout(tracker.wait_s)
        try:
            reply = _recv(sock)
        except socket.timeout:
            raise NoServer(f"no RPC server under key '{tracker.key}' became free within {tracker.wait_s:g} s") from None
    finally:
        sock.close()  # the tracker drops a pending request whose connection closed
    if not isinstance(reply, list) or reply[0] != CODE_SUCCESS:
        raise ConnectionError(f"tracker refused the request: {reply}")
    url, port, matchkey = reply[1]
    try:
        return rpc.connect(url, port, matchkey, session_timeout=int(session_timeout) + 1), f"{url}:{port}"
    except Exception as e:  # noqa: BLE001 - the server the tracker gave us did not answer
        raise ServerFailed(f"{url}:{port}", f"{type(e).__name__}: connecting failed: {e}") from None


def describe_device(tracker: Tracker, device_type: str) -> str:
    """What the servers under the key measure on (recorded in the tuning database);
    QtvmError when their runtime lacks the target's device (e.g. OpenCL)."""
    try:
        sess, addr = request_session(tracker, tracker.timeout_s)
    except NoServer as e:
        raise QtvmError(str(e), tracker.start_hint()) from None
    except Exception as e:  # noqa: BLE001 - any failure to open a session is the device's
        raise QtvmError(f"cannot open an RPC session with a server under key '{tracker.key}' "
                        f"({type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''})",
                        tracker.start_hint()) from None
    dev = sess.device(device_type, 0)
    if not dev.exist:
        raise QtvmError(f"the RPC server {addr} under key '{tracker.key}' has no {device_type} device",
                        f"serve with a TVM runtime built with {device_type} (on a phone: TVM's RPC app)")
    name = None
    if device_type != "cpu" and device_type != "llvm":
        try:
            name = dev.device_name
        except Exception:  # noqa: BLE001 - optional attribute
            name = None
    return f"rpc key {tracker.key}: {name or device_type}"


# ---------------------------------------------------------------------- measurement


def _measure_remote(tracker: Tracker, artifact_path: str, device_type: str, args_info: tuple,
                    evaluator) -> tuple[str, str | None, object]:
    """In a worker process: ("ok", server, costs) | ("error", server, message) | ("no-server", None, message)."""
    from tvm.s_tir.meta_schedule.runner import rpc_runner

    try:
        sess, addr = request_session(tracker, tracker.timeout_s)
    except NoServer as e:
        return "no-server", None, str(e)
    except ServerFailed as e:
        return "error", e.addr, str(e)
    except Exception as e:  # noqa: BLE001
        return "error", None, f"{type(e).__name__}: {e}"
    remote_path = os.path.basename(artifact_path)
    try:
        dev = sess.device(device_type, 0)
        rt_mod = rpc_runner.default_upload_module(sess, artifact_path, remote_path)
        args = rpc_runner.default_alloc_argument(sess, dev, args_info, 1)
        costs = rpc_runner.default_run_evaluator(sess, rt_mod, dev, evaluator, args)
        try:
            rpc_runner.default_cleanup(sess, remote_path)
        except Exception:  # noqa: BLE001 - measured already
            pass
        return "ok", addr, [float(c) for c in costs]
    except Exception as e:  # noqa: BLE001
        return "error", addr, f"{type(e).__name__}: {e}"


@dataclass
class _Health:
    """What the runner saw of the servers, shared by its futures."""

    tracker: Tracker
    log: object
    known: set = field(default_factory=set)  # servers seen registered
    lost: set = field(default_factory=set)
    notes: list = field(default_factory=list)
    fatal: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def say(self, text: str) -> None:
        with self.lock:
            self.notes.append(text)
        if self.log is not None:
            self.log(text)

    def current(self) -> list[str] | None:
        try:
            return servers(summary(self.tracker), self.tracker.key)
        except QtvmError:
            return None

    def refresh(self) -> list[str] | None:
        """Compare the registered servers with those seen before; say who left."""
        now = self.current()
        if now is None:
            return None
        gone = sorted((self.known - set(now)) - self.lost)
        for addr in gone:
            self.lost.add(addr)
            self.say(f"RPC server {addr} (key {self.tracker.key}) left the tracker; measuring on the remaining "
                     f"{len(now)} server(s)")
        self.known |= set(now)
        return now

    def lost_server(self, addr: str | None, message: str) -> bool:
        """Did the failure come from the server's connection (then measure again), rather
        than from the kernel?  A server that left the tracker is named as lost."""
        words = any(w in message.lower() for w in _LOST_WORDS)
        gone, now = False, None
        for _ in range(4):  # the tracker notices a closed server connection within moments
            now = self.current()
            gone = addr is not None and now is not None and addr not in now
            if gone or not words:
                break
            time.sleep(0.5)
        if not (gone or words):
            return False
        remaining = len(now) if now is not None else "?"
        if gone and addr not in self.lost:
            self.lost.add(addr)
            self.say(f"RPC server {addr} (key {self.tracker.key}) was lost during a measurement; measuring that "
                     f"candidate again on the remaining {remaining} server(s)")
        elif not gone:
            self.say(f"RPC measurement on {addr or 'a server'} failed with a connection error; measuring it again")
        return True


@derived_object
class _TrackerFuture(ms.runner.PyRunnerFuture):
    def __init__(self, runner: "TrackerRunner", job: tuple) -> None:
        super().__init__()
        self.runner, self.job, self.attempt = runner, job, 1
        self.future = runner.submit(job)

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> ms.runner.RunnerResult:
        health = self.runner.health
        while True:
            try:
                status, addr, value = self.future.result()
            except Exception as e:  # noqa: BLE001 - TimeoutError: the worker was killed
                status, addr, value = "error", None, f"{type(e).__name__}: measurement did not finish in " \
                                                     f"{self.runner.job_timeout:g} s"
            if status == "ok":
                return ms.runner.RunnerResult(value, None)
            if status == "no-server":
                health.fatal = health.fatal or (f"{value}: every RPC server under key '{health.tracker.key}' is gone"
                                                if health.lost else value)
                raise NoServer(health.fatal)
            if self.attempt < MAX_ATTEMPTS and health.lost_server(addr, str(value)):
                self.attempt += 1
                self.future = self.runner.submit(self.job)
                continue
            return ms.runner.RunnerResult(None, f"RPC measurement failed: {str(value)[:1000]}")


@derived_object
class TrackerRunner(ms.runner.PyRunner):
    """MetaSchedule runner over the tracker's servers under one key, one worker per server."""

    def __init__(self, tracker: Tracker, evaluator: ms.runner.EvaluatorConfig, workers: int,
                 log=None, known: list[str] | None = None) -> None:
        from tvm.support.popen_pool import PopenPoolExecutor

        super().__init__()
        self.tracker, self.evaluator = tracker, evaluator
        self.health = _Health(tracker, log, set(known or []))
        self.job_timeout = tracker.wait_s + tracker.timeout_s + 30.0
        self.pool = PopenPoolExecutor(max_workers=max(1, workers), timeout=self.job_timeout)

    @property
    def notes(self) -> list[str]:
        return list(self.health.notes)

    def submit(self, job: tuple):
        return self.pool.submit(_measure_remote, self.tracker, *job)

    def run(self, runner_inputs):
        self.health.refresh()
        return [_TrackerFuture(self, (str(inp.artifact_path), str(inp.device_type),
                                      tuple(info.as_json() for info in inp.args_info), self.evaluator))
                for inp in runner_inputs]
