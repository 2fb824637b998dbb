"""qtvm.atomic: a file is replaced whole or left as it was, also with writers racing."""
from __future__ import annotations

import threading

import pytest

from qtvm.atomic import atomic_file


def test_writers_of_one_path_at_once_each_replace_it_whole(tmp_path):
    """Eight writers open the same path before any closes (two test workers filling one
    runtime cache did so): every one succeeds, the file is one writer's whole content, and
    no temp file is left."""
    target, n = tmp_path / "libtvm_ffi.so", 8
    opened = threading.Barrier(n)
    errors = []

    def write(i):
        try:
            with atomic_file(target) as f:
                f.write(bytes([i]) * 1000)
                opened.wait(timeout=30)
                f.write(bytes([i]) * 1000)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    data = target.read_bytes()
    assert len(data) == 2000 and len(set(data)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert target.stat().st_mode == plain.stat().st_mode  # the mode open() gives, not mkstemp's 0600
    plain.unlink()


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(target, "w") as f:
            f.write("half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
