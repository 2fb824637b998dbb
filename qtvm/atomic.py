"""Files written whole or not at all: the content goes to a temp file beside the target,
renamed over it when complete. The temp name is unique to each writer, so processes that
write the same path at once (two test workers filling one cache) each rename a complete file
(a shared ``.part`` name had one worker rename the other's file from under it)."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

_UMASK = os.umask(0o022)  # read once (setting it is the only way): per call, a thread creating a file
os.umask(_UMASK)  # at that moment would get the temporary mask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb"):
    """A file object for ``path``'s new content; ``path`` is replaced when the block ends
    without an exception, and left as it was (no temp file behind) when it raises."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # what open() would give (mkstemp's is 0600)
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
