"""An artefact's weights: one blob in the library, beside (not inside) the VM's module.

``relay_passes.lift_weights`` takes the weights out of the VM's constants; the export links
them in as this blob under the symbol ``qtvm_weights`` (``.incbin``, like the module), and a
loader (``qtvm.runtime``, the C++ ``qtvm_run``) finds it with ``dlsym``, copies it once into
tensors TVM allocates on huge pages (a weight-streaming kernel reads 2 MiB pages ~1.3x
faster: ``qtvm.hugepages``), drops the library's pages of it as it goes, and passes each
entry point the weights it takes: its trailing parameters ``qtvm_w<index>`` (one argument a
weight, so nothing is unpacked per call). Loading holds the weights about once; through the
VM's constants it held them ~4x at the peak and ~2x after (a TinyLlama-1.1B-shaped int4
artefact, 913 MB: 3.85 GB peak and 2.07 GB after, now 1.20 GB and 1.20 GB).

Layout (little-endian): ``MAGIC``; u64 count; u64 data_start; then per weight u64 offset,
u64 nbytes, u8 type code, u8 bits, u16 lanes (DLPack's DLDataType), u32 ndim, i64 dims[ndim];
the data from ``data_start`` (a multiple of 4096), each weight at a multiple of 64 bytes
(TVM's alignment for memory it is handed). Offsets count from the blob's first byte.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"QTVMWTS1"
SYMBOL = "qtvm_weights"
PARAM_PREFIX = "qtvm_w"  # an entry point's parameter holding weight <index> (relay_passes.lift_weights)
DATA_ALIGN = 4096
WEIGHT_ALIGN = 64
COPY_CHUNK = 8 << 20  # the library's pages are dropped after each chunk is copied
MADV_DONTNEED = 4
#: DLPack type codes and the dtype names TVM spells them with.
TYPE_CODES = {0: "int", 1: "uint", 2: "float", 4: "bfloat"}


def weight_index(param_name: str) -> int | None:
    """The weight a parameter named by ``lift_weights`` holds (None for other parameters)."""
    digits = param_name[len(PARAM_PREFIX):]
    return int(digits) if param_name.startswith(PARAM_PREFIX) and digits.isdigit() else None


@dataclass(frozen=True)
class Entry:
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _type_fields(dtype: str) -> tuple[int, int, int]:
    t = _tvm_dtype(dtype)
    if int(t.type_code) not in TYPE_CODES:
        raise ValueError(f"weights of dtype {dtype} are not stored in the blob")
    return int(t.type_code), int(t.bits), int(t.lanes)


def tensor_nbytes(t) -> int:
    """The bytes a TVM tensor's elements take."""
    dtype = _tvm_dtype(str(t.dtype))
    return int(np.prod([int(d) for d in t.shape], dtype=np.int64)) * int(dtype.bits) * int(dtype.lanes) // 8


def tensor_bytes(t) -> np.ndarray:
    """A CPU tensor's memory as a flat uint8 numpy view (no copy; bfloat16 too, which numpy
    cannot view as it is)."""
    return np.from_dlpack(t._create_view((tensor_nbytes(t),), "uint8"))


def _tvm_dtype(dtype: str):
    import tvm

    return tvm.DataType(dtype)


def storable(dtype: str) -> bool:
    """A weight of ``dtype`` can go in the blob (ints, floats, bfloat16)."""
    try:
        _type_fields(dtype)
    except ValueError:
        return False
    return True


def _dtype_name(code: int, bits: int, lanes: int) -> str:
    return f"{TYPE_CODES[code]}{bits}" + (f"x{lanes}" if lanes > 1 else "")


def write_blob(weights: list, path: str | os.PathLike) -> int:
    """Write TVM CPU tensors ``weights`` as a blob to ``path``; returns its size in bytes."""
    header = bytearray(MAGIC + struct.pack("<QQ", len(weights), 0))
    records, offset = [], 0
    for w in weights:
        shape = [int(d) for d in w.shape]
        code, bits, lanes = _type_fields(str(w.dtype))
        nbytes = tensor_nbytes(w)
        offset = _round_up(offset, WEIGHT_ALIGN)
        records.append((offset, nbytes))
        header += struct.pack("<QQBBHI", offset, nbytes, code, bits, lanes, len(shape))
        header += struct.pack(f"<{len(shape)}q", *shape)
        offset += nbytes
    data_start = _round_up(len(header), DATA_ALIGN)
    struct.pack_into("<Q", header, len(MAGIC) + 8, data_start)
    with open(path, "wb") as f:
        f.write(header)
        for w, (off, nbytes) in zip(weights, records):
            f.seek(data_start + off)
            f.write(memoryview(tensor_bytes(w)))
        f.truncate(data_start + offset)
    return data_start + offset


def read_table(read) -> tuple[int, list[Entry]]:
    """(data_start, entries) from ``read(offset, n) -> bytes`` over the blob."""
    head = read(0, len(MAGIC) + 16)
    if head[:len(MAGIC)] != MAGIC:
        raise ValueError("not a qtvm weights blob")
    count, data_start = struct.unpack_from("<QQ", head, len(MAGIC))
    table = read(0, data_start)
    pos, entries = len(MAGIC) + 16, []
    for _ in range(count):
        offset, nbytes, code, bits, lanes, ndim = struct.unpack_from("<QQBBHI", table, pos)
        pos += struct.calcsize("<QQBBHI")
        shape = struct.unpack_from(f"<{ndim}q", table, pos)
        pos += 8 * ndim
        entries.append(Entry(offset, nbytes, _dtype_name(code, bits, lanes), tuple(shape)))
    return data_start, entries


class LoadedWeights:
    """An artefact's weights copied out of its library (see the module's docstring):
    ``tensors``, indexed as the entry points' weight parameters name them.

    Each weight is a tensor TVM allocates, as the VM's constants were: views into one anonymous
    mapping ran the TinyLlama-1.1B-shaped decode step 3.7% slower on huge pages and 20% on 4 KiB
    pages (Zen 4, 1 thread, same artefact, same bytes); TVM's own tensors passed through DLPack
    ran as fast as TVM's, so it is the one mapping, for a reason not found."""

    def __init__(self, address: int):
        import tvm.runtime

        from qtvm.hugepages import NewMemoryOnHugePages

        data_start, self.entries = read_table(lambda off, n: ctypes.string_at(address + off, n))
        # advised before the copy writes them (most fault in as 2 MiB pages: 540 of 905 MB here);
        # the runtime collapses the rest after the load (880-905 MB)
        with NewMemoryOnHugePages(written=False):
            self.tensors = [tvm.runtime.empty(e.shape, e.dtype) for e in self.entries]
        for e, tensor in zip(self.entries, self.tensors):
            src = address + data_start + e.offset
            dst = tensor_bytes(tensor)
            for lo in range(0, e.nbytes, COPY_CHUNK):
                hi = min(lo + COPY_CHUNK, e.nbytes)
                dst[lo:hi] = np.ctypeslib.as_array((ctypes.c_uint8 * (hi - lo)).from_address(src + lo))
                _drop_pages(src + lo, src + hi)


class FileWeights:
    """The weights as copy-on-write views of the artefact file's own pages: nothing is copied, and
    the pages stay the file's (the kernel reclaims them under pressure). For a load that only
    checks the artefact (the compile's KV check, while the compile still holds its module): views
    into one mapping run slower than ``LoadedWeights``' tensors. ``FileWeights.of`` is None where
    the blob is not at a file's page (the library loaded from a copy since deleted)."""

    def __init__(self, file: str, offset: int, address: int):
        import tvm.runtime

        data_start, self.entries = read_table(lambda off, n: ctypes.string_at(address + off, n))
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        end = offset + data_start + max((e.offset + e.nbytes for e in self.entries), default=0)
        with open(file, "rb") as f:
            self._map = mmap.mmap(f.fileno(), end - base, access=mmap.ACCESS_COPY, offset=base)
        self.tensors = []
        for e in self.entries:
            at = offset - base + data_start + e.offset
            raw = np.frombuffer(self._map, np.uint8, count=e.nbytes, offset=at)
            if e.dtype in ("float32", "float16", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64") \
                    and raw.ctypes.data % WEIGHT_ALIGN == 0:
                self.tensors.append(tvm.runtime.from_dlpack(raw.view(e.dtype).reshape(e.shape)))
            else:  # a type numpy lays out otherwise (bfloat16): a copy
                tensor = tvm.runtime.empty(e.shape, e.dtype)
                tensor_bytes(tensor)[:] = raw
                self.tensors.append(tensor)

    @staticmethod
    def of(address: int) -> "FileWeights | None":
        """The blob at ``address`` (in a loaded library) through its file, from /proc/self/maps."""
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    lo, hi = (int(v, 16) for v in fields[0].split("-"))
                    if lo <= address < hi and len(fields) == 6 and fields[5].startswith("/"):
                        file = fields[5].rstrip("\n")
                        if file.endswith(" (deleted)"):
                            return None
                        return FileWeights(file, address - lo + int(fields[2], 16), address)
        except (OSError, ValueError):
            pass
        return None


def _drop_pages(lo: int, hi: int) -> None:
    """Unmap the library's whole pages in [lo, hi) from this process (read-only file pages:
    they stay in the page cache and would be read back if touched), so the copy is the only one
    resident."""
    from qtvm.hugepages import libc_madvise

    page = mmap.PAGESIZE
    lo, hi = _round_up(lo, page), hi // page * page
    if hi > lo:
        libc_madvise()(lo, hi - lo, MADV_DONTNEED)


def find(path: str | os.PathLike) -> int | None:
    """The address of the weights blob in the library at ``path`` (already loaded by TVM: this
    opens the same handle), or None where it has none (weights in the VM's constants)."""
    try:
        lib = ctypes.CDLL(str(Path(path).resolve()), mode=os.RTLD_LAZY | getattr(os, "RTLD_NOLOAD", 0))
    except OSError:
        return None
    try:
        return ctypes.addressof(ctypes.c_char.in_dll(lib, SYMBOL))
    except ValueError:
        return None
