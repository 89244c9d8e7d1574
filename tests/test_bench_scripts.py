"""Every script in ``bench/`` still imports: the benches run only by hand or on a lent GPU, so a
name moved in ``diffckpt`` would otherwise break one unseen until its figures are wanted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import subprocess_env

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_every_bench_script_imports() -> None:
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert {"fast_steps", "gpu_check", "pipeline"} <= set(names)
    script = ("import importlib, sys\n"
              f"sys.path[:0] = [{str(BENCH.parent)!r}, {str(BENCH)!r}]\n"
              f"for name in {names!r}:\n"
              "    importlib.import_module(name)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
