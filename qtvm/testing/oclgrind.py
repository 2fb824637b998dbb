"""Run scheduled GPU kernels under Oclgrind, an OpenCL device simulator that checks every
memory access: data races between work-items (``--data-races``: local and global memory,
including a missing barrier around a cross-thread sum), reads of uninitialized values and
out-of-bounds accesses, and OpenCL API misuse.

    programs = [(opencl.build(func), [x, *weights, y]), ...]
    result = run(programs)        # one subprocess under `oclgrind`, every program in turn
    result.errors                 # Oclgrind's error reports (empty when clean)
    result.outputs[i]             # program i's arrays after its run

Oclgrind replaces the OpenCL library of the process it starts, so the programs run in a
child process (``python3 -m qtvm.testing.oclgrind``) that replays each host launch plan
exactly as ``qtvm.testing.opencl`` does on PoCL. Oclgrind has no cl_khr_fp16 either:
fp16 kernels run with half spelled float, as on PoCL.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qtvm.errors import QtvmError
from qtvm.testing.opencl import Program

#: Oclgrind's checks: data races and uninitialized values (out-of-bounds accesses are always on).
FLAGS = ("--data-races", "--uninitialized", "--max-errors", "20")
#: Lines of Oclgrind's log that report a problem (it prints nothing else there).
_ERROR = re.compile(r"(data race|uninitiali[sz]ed|invalid (read|write)|out of bounds|error|warning)", re.I)


@dataclass
class Result:
    outputs: list      # per program: its arrays after the run
    errors: list       # Oclgrind's reports, one line each
    log: str


def available() -> bool:
    return shutil.which("oclgrind") is not None


def run(programs: list[tuple[Program, list[np.ndarray]]], *, local_mem_bytes: int | None = None,
        timeout: float = 600) -> Result:
    """Run each (program, arrays) under Oclgrind; ``local_mem_bytes`` sets the simulated
    device's local memory (a phone GPU's 32 KiB, say)."""
    import tvm

    if not available():
        raise QtvmError("oclgrind is not installed", "apt-get install oclgrind")
    cases = [{"source": p.source, "host": tvm.ir.save_json(p.host), "params": p.kernel_params,
              "half_as_float": p.half_as_float, "options": list(p.options), "arrays": arrays}
             for p, arrays in programs]
    with tempfile.TemporaryDirectory() as tmp:
        case_file, out_file, log_file = Path(tmp, "cases.pkl"), Path(tmp, "out.pkl"), Path(tmp, "oclgrind.log")
        case_file.write_bytes(pickle.dumps(cases))
        flags = [*FLAGS, "--log", str(log_file)]
        if local_mem_bytes:
            flags += ["--local-mem-size", str(local_mem_bytes)]
        command = ["oclgrind", *flags, sys.executable, "-m", "qtvm.testing.oclgrind", str(case_file), str(out_file)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                                                         os.environ.get("PYTHONPATH")])))
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        log = log_file.read_text() if log_file.exists() else ""
        if done.returncode != 0 or not out_file.exists():
            raise QtvmError(f"the programs did not run under oclgrind (exit {done.returncode}): "
                            f"{(done.stderr or log).strip()[-2000:]}")
        outputs = pickle.loads(out_file.read_bytes())
    log = log + done.stderr
    errors = [line for line in log.splitlines() if _ERROR.search(line)]
    return Result(outputs, errors, log)


def _child(case_file: str, out_file: str) -> None:
    """In the process Oclgrind started: replay every program on its simulated device."""
    import tvm

    from qtvm.testing.opencl import default_context

    outputs = []
    for case in pickle.loads(Path(case_file).read_bytes()):
        program = Program(None, case["source"], tvm.ir.load_json(case["host"]), case["params"],
                          case["half_as_float"], tuple(case["options"]))
        arrays = [np.array(a) for a in case["arrays"]]
        program.run(*arrays, device=default_context())
        outputs.append(arrays)
    tmp = f"{out_file}.tmp"
    Path(tmp).write_bytes(pickle.dumps(outputs))
    os.replace(tmp, out_file)


if __name__ == "__main__":
    _child(*sys.argv[1:3])
