from __future__ import annotations

import math
from pathlib import Path

import pytest

from qtvm.bench import bandwidth


def test_l3_cache_bytes_matches_sysfs():
    l3 = bandwidth.l3_cache_bytes()
    assert l3 > 0
    p = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    if p.exists():
        assert l3 == bandwidth._parse_size(p.read_text())
    assert bandwidth.default_buffer_bytes() == max(2 * l3, 512 << 20)


@pytest.mark.parametrize("text,expected", [("32768K", 32 << 20), ("491520K", 480 << 20), ("8M\n", 8 << 20), ("1024", 1024)])
def test_parse_size(text, expected):
    assert bandwidth._parse_size(text) == expected


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError):
        bandwidth._parse_size("lots")


def test_small_buffer_bandwidth_is_positive_finite(tmp_path, monkeypatch):
    monkeypatch.setenv("QTVM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bandwidth, "_lib", None)
    for threads in (1, 2):
        gbps = bandwidth.measure_read_bandwidth(threads, size_bytes=8 << 20, repeats=3)
        assert math.isfinite(gbps) and gbps > 0
    # built into the cache dir we pointed at
    assert list((tmp_path / "bandwidth").glob("readbw_*.so"))


@pytest.mark.parametrize("streams", [1, 3, 8])
def test_streams_and_odd_sizes_read_everything(streams):
    # the kernel verifies its checksum (sum of all int32 ones) and raises otherwise;
    # an odd number of lines exercises the per-thread and per-stream tails
    samples = bandwidth.measure_read_bandwidth_samples(2, size_bytes=64 * 1001, repeats=2, streams=streams)
    assert len(samples) == 2 and all(s > 0 for s in samples)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        bandwidth.measure_read_bandwidth(0, size_bytes=1 << 20)
    with pytest.raises(ValueError):
        bandwidth.measure_read_bandwidth(1, size_bytes=1 << 20, streams=9)


def test_missing_gcc_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(bandwidth, "_lib", None)
    monkeypatch.setenv("QTVM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(bandwidth.shutil, "which", lambda name: None)
    with pytest.raises(bandwidth.GccNotFoundError, match="gcc"):
        bandwidth.measure_read_bandwidth(1, size_bytes=1 << 20)


def test_probe_reuses_buffer_and_reports_per_stream():
    probe = bandwidth.BandwidthProbe(4 << 20)
    ptr = probe.buf.ctypes.data
    detail = probe.measure_detail(1, repeats=2)
    assert set(detail) == set(bandwidth.STREAM_CANDIDATES)
    assert all(math.isfinite(v) and v > 0 for v in detail.values())
    assert probe.measure(2, repeats=1, streams=2) > 0
    assert probe.buf.ctypes.data == ptr


def test_probe_on_huge_pages_advises_its_whole_buffer(monkeypatch):
    """The gemv bench puts its weights on huge pages; its probe's buffer must be asked onto them
    too, or the bar the kernels are judged against is a 4 KiB-page reader's."""
    from qtvm import hugepages

    asked = []
    monkeypatch.setenv(hugepages.ENV, "1")
    monkeypatch.setattr(hugepages, "back_with_huge_pages", lambda ranges, collapse=True: asked.extend(ranges) or 1)
    probe = bandwidth.BandwidthProbe(64 << 20, huge_pages=True)  # above glibc's mmap threshold: its own mapping
    lo, hi = probe.buf.ctypes.data, probe.buf.ctypes.data + probe.nbytes
    assert any(a <= lo and hi <= b for a, b in asked), (hex(lo), [(hex(a), hex(b)) for a, b in asked])
    assert probe.huge_page_bytes == 1
    asked.clear()
    assert bandwidth.BandwidthProbe(64 << 20).huge_page_bytes == 0 and not asked
