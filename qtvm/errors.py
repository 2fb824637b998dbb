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
