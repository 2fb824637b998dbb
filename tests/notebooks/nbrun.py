"""Execute the notebooks under a real Jupyter kernel (nbclient + ipykernel), and compare outputs.

Regenerate the committed outputs after changing code the notebooks show:

    PYTHONPATH=$PWD python3 -m tests.notebooks.nbrun notebooks/*.ipynb     # executes and writes in place

Comparing a fresh execution with the committed outputs (tests/notebooks/test_notebooks.py):
images count, not their pixels; stderr is ignored (warnings); consecutive stream chunks are
joined; temporary paths and addresses are masked. Numbers are compared apart from the text:
the text with every number masked must be equal, and the numbers equal to 1 % (printing
rounds differently when a last bit differs between CPUs). Cells tagged ``machine-dependent``
(timings, errors that follow the CPU's summation order, the host's CPU name and flags, sizes of
host-compiled code) are compared by their layout: the same outputs, each with the same lines (or
table rows) carrying the same labels.
"""
from __future__ import annotations

import math
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
MACHINE_TAG = "machine-dependent"
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_MASKS = [(re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
          (re.compile(r"/tmp/[\w./-]*"), "<tmp>"),
          (re.compile(r"[ \t]+"), " ")]


def execute(path: Path, extra: str | None = None, timeout: int = 600):
    """(executed notebook, seconds, text output of ``extra`` run after the last cell).

    The kernel starts in the repository root with this process's environment (PYTHONPATH),
    so it imports the code under test."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(ROOT))
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env.pop("QTVM_PROGRESS", None)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(ROOT)}})
    start = time.perf_counter()
    extra_text = None
    with client.setup_kernel(env=env):
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        seconds = time.perf_counter() - start
        if extra is not None:
            probe = nbformat.v4.new_code_cell(extra)
            nb.cells.append(probe)  # nbclient writes the executed cell back by index
            try:
                client.execute_cell(probe, len(nb.cells) - 1)
            finally:
                nb.cells.pop()
            extra_text = "".join(o.get("text", "") for o in probe.outputs if o.get("output_type") == "stream"
                                 and o.get("name") == "stdout")
    return nb, seconds, extra_text


def _outputs(cell) -> list[tuple[str, str]]:
    """(kind, text) per output: streams joined by name, stderr dropped, images as a marker."""
    out: list[tuple[str, str]] = []
    for o in cell.get("outputs", []):
        kind = o["output_type"]
        if kind == "stream":
            if o["name"] == "stderr":
                continue
            text = o["text"] if isinstance(o["text"], str) else "".join(o["text"])
            if out and out[-1][0] == "stdout":
                out[-1] = ("stdout", out[-1][1] + text)
            else:
                out.append(("stdout", text))
        elif kind in ("display_data", "execute_result"):
            data = o.get("data", {})
            if "image/png" in data or "image/svg+xml" in data:
                out.append(("image", ""))
            elif "text/html" in data:
                html = data["text/html"]
                out.append(("html", html if isinstance(html, str) else "".join(html)))
            else:
                text = data.get("text/plain", "")
                out.append(("text", text if isinstance(text, str) else "".join(text)))
        elif kind == "error":
            out.append(("error", f"{o.get('ename')}: {o.get('evalue')}"))
    return out


def _split(text: str) -> tuple[str, list[float]]:
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    numbers = [float(m) for m in _NUMBER.findall(text)]
    return _NUMBER.sub("#", text), numbers


def _layout(kind: str, text: str) -> str:
    """What stays when the machine changes: the label of each line (its first word), or of
    each table row in HTML (its first cell)."""
    if kind == "html":
        rows = re.findall(r"<tr>(.*?)</tr>", text, re.S)
        return "\n".join(re.sub(r"<[^>]+>", "", (re.findall(r"<t[dh]>(.*?)</t[dh]>", r, re.S) or [""])[0]) for r in rows)
    return "\n".join((line.split() or [""])[0] for line in text.splitlines())


def differences(committed, fresh) -> list[str]:
    """Where ``fresh`` (executed now) differs from ``committed`` beyond what the rules allow."""
    problems = []
    code = [(c, f) for c, f in zip(committed.cells, fresh.cells) if c.cell_type == "code"]
    if len(committed.cells) != len(fresh.cells):
        return ["the notebooks have different cells"]
    for n, (cc, fc) in enumerate(code):
        machine = MACHINE_TAG in cc.get("metadata", {}).get("tags", [])
        a, b = _outputs(cc), _outputs(fc)
        where = f"code cell {n} ({cc.source.strip().splitlines()[0][:60]!r})"
        if [k for k, _ in a] != [k for k, _ in b]:
            problems.append(f"{where}: output kinds {[k for k, _ in a]} committed, {[k for k, _ in b]} now")
            continue
        for (kind, ta), (_, tb) in zip(a, b):
            (sa, na), (sb, nb_) = _split(ta), _split(tb)
            if machine:  # the CPU's name, flags and timings vary: compare the layout, row by row
                sa, sb = _layout(kind, sa), _layout(kind, sb)
            if sa != sb:
                first = next(i for i, (x, y) in enumerate(zip(sa + "\0", sb + "\1")) if x != y)
                problems.append(f"{where}: text differs at ...{sa[max(0, first - 60):first + 40]!r} "
                                f"vs ...{sb[max(0, first - 60):first + 40]!r}")
            elif not machine:
                bad = [(x, y) for x, y in zip(na, nb_) if not math.isclose(x, y, rel_tol=1e-2, abs_tol=1e-12)]
                if bad:
                    problems.append(f"{where}: numbers differ (committed, now): {bad[:5]}")
    return problems


def main(paths: list[str]) -> int:
    import nbformat

    for p in paths or sorted(NOTEBOOKS.glob("*.ipynb")):
        path = Path(p)
        nb, seconds, _ = execute(path)
        nbformat.write(nb, str(path))
        print(f"{path}: executed in {seconds:.0f} s, outputs written")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
