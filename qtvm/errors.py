"""One exception type for every mistake a user can make.

The CLI prints ``QtvmError`` as a single line and exits with code 2; anything
else is a bug in qtvm and keeps its traceback.
"""


class QtvmError(Exception):
    """A user-facing error: what is wrong, and how to fix it, in one line."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem.rstrip('.')}; {fix}" if fix else problem)


def require_compiler_tvm() -> None:
    """Refuse, in one line, a compile in a process that imported ``qtvm.runtime`` first: it
    loaded TVM's runtime library only, and the compiler's modules then fail deep inside TVM
    ("module 'tvm.ir._ffi_api' has no attribute 'RegisterOpAttr'")."""
    import sys

    tvm = sys.modules.get("tvm")
    if tvm is not None and getattr(getattr(tvm, "base", None), "_RUNTIME_ONLY", False):
        raise QtvmError("this process imported qtvm.runtime before the compiler, so it holds TVM's runtime "
                        "library only", "import qtvm.pipeline (or qtvm.explore) before qtvm.runtime, or "
                        "compile in another process")
