"""Shared test helpers: run training subprocesses, kill them for real, compare states bitwise."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def script_env(overrides: dict[str, str | None] | None = None) -> dict[str, str]:
    """:func:`subprocess_env` with ``overrides`` applied; a ``None`` value removes that variable."""
    env = subprocess_env()
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, found through ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it. Launchers such as torchrun
    start their workers in sessions of their own, so killing the group alone would leave the
    training processes running."""
    below = descendants(pid)
    for target in [pid, *below]:
        try:
            os.kill(target, signal.SIGSTOP)  # freeze first: nothing may run on while we kill
        except ProcessLookupError:
            pass
    os.killpg(pid, signal.SIGKILL)
    for target in below:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_script(script: str, args: list[str], kill_at_step: int | None = None, timeout: float = 300,
               prefix: list[str] | None = None, env: dict[str, str | None] | None = None,
               drain: bool = False) -> tuple[int, str]:
    """Run a training script; with ``kill_at_step``, SIGKILL it once it prints ``STEP <n>`` with
    ``n >= kill_at_step`` (steps can advance by more than one, e.g. with two optimizers).

    ``env`` is merged over :func:`subprocess_env`; a ``None`` value removes that variable.
    ``drain``: the log also holds what the script printed before the kill landed and was not read
    yet (on a loaded machine a tiny model may be several steps past ``kill_at_step`` by then)."""
    cmd = (prefix or [sys.executable]) + [os.path.join(ROOT, script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=script_env(env), start_new_session=True)
    lines = read_output(proc, kill_at_step, drain)
    rc = proc.wait(timeout=timeout)
    return rc, "".join(lines)


def read_output(proc: subprocess.Popen[str], kill_at_step: int | None, drain: bool = False) -> list[str]:
    """The lines ``proc`` prints until it ends or, with ``kill_at_step``, until it prints
    ``STEP <n>`` with ``n >= kill_at_step``, when it is killed with every descendant; with
    ``drain``, also what it had printed before it died and was not read yet (its last step)."""
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if kill_at_step is not None and (step := step_of(line)) is not None and step >= kill_at_step:
            kill_tree(proc.pid)
            if drain:
                lines += proc.stdout.readlines()
            break
    proc.stdout.close()
    return lines


def finish_process() -> None:
    """End a training script that has written everything: destroy the default process group (as
    torch asks), flush, and exit without interpreter finalization.

    Finalizing a process that trained under DDP on gloo aborts it now and then, after training
    finished and its results were saved ("terminate called without an active exception",
    SIGABRT), even after ``destroy_process_group()``: the DDP module and Accelerate still hold
    the group, whose C++ worker threads are then torn down with the interpreter (torch's
    upstream issues on gloo teardown at exit). Nothing is left to run at that point, so the
    scripts skip it rather than fail a test at random."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


PACE_FROM = "DIFFCKPT_TEST_PACE_FROM"
PACE_S = 0.3


def log_to_stdout() -> None:
    """diffckpt's INFO lines and warnings on stdout, with a script's STEP lines (for the tests that
    read them); only in a script run as one, so that in-process runs leave pytest's logging alone."""
    import logging

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    diff_log = logging.getLogger("diffckpt")
    diff_log.addHandler(handler)
    diff_log.setLevel(logging.INFO)
    diff_log.propagate = False


def print_step(step: int) -> None:
    """Print ``STEP <n>`` for the parent test. From the step ``DIFFCKPT_TEST_PACE_FROM`` names on
    (:func:`terminate_at_step` sets it), pause after it: the parent signals when it reads the line,
    and on a loaded machine it may read it late, or a launcher may forward the signal late, while
    a tiny model's steps take milliseconds."""
    print(f"STEP {step}", flush=True)
    pace_from = os.environ.get(PACE_FROM)
    if pace_from is not None and step >= int(pace_from):
        time.sleep(PACE_S)


def terminate_at_step(script: str, args: list[str], at_step: int, prefix: list[str] | None = None,
                      env: dict[str, str | None] | None = None, timeout: float = 120
                      ) -> tuple[int, str, int | None, int]:
    """Run a training script and send SIGTERM to it (the first process: a launcher forwards it)
    once it prints ``STEP <n>`` with ``n >= at_step`` (the script paces its steps from there:
    :func:`print_step`). Returns the exit status, the log, the step after which it was sent
    (``None``: never) and the last step printed."""
    cmd = (prefix or [sys.executable]) + [os.path.join(ROOT, script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=script_env({PACE_FROM: str(at_step), **(env or {})}), start_new_session=True)
    lines, sent_after = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if sent_after is None and (step := step_of(line)) is not None and step >= at_step:
            sent_after = step
            proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=timeout)
    return rc, "".join(lines), sent_after, last_step("".join(lines))


def last_step(log: str) -> int:
    """The last ``STEP <n>`` a script printed (-1: none). Of a run killed with
    ``run_script(..., drain=True)``: the step it had reached when the kill landed, which on a
    loaded machine may be several past ``kill_at_step``, since the test reads the log late."""
    return max(steps_in(log), default=-1)


def step_of(line: str) -> int | None:
    """The step of a ``STEP <n>`` line a script printed, else ``None``. The line may run on into
    a log line that another thread wrote between print's two writes (``STEP 27INFO diffckpt: ...``):
    only the digits are the step."""
    m = re.match(r"STEP (\d+)", line)
    return int(m[1]) if m else None


def steps_in(log: str) -> list[int]:
    """Every ``STEP <n>`` a script printed, in order."""
    return [s for line in log.splitlines() if (s := step_of(line)) is not None]


def run_training(script: str, args: list[str], prefix: list[str] | None = None, **kw: Any) -> str:
    """:func:`run_script` that must end as asked: killed (``kill_at_step``) or with status 0;
    returns the log."""
    rc, log = run_script(script, args, prefix=prefix, **kw)
    if kw.get("kill_at_step") is None:
        assert rc == 0, log[-3000:]
    else:
        assert rc == -9, f"training was not killed: {log[-2000:]}"
    return log


def samples_seen(path: Any, ranks: int, epoch: int, steps: tuple[int, int] = (0, 10**9)) -> list[int]:
    """The sample indices every rank logged (``--log-samples path``: ``epoch step id ...`` lines in
    ``path.rank<r>``) for ``epoch`` at optimizer steps ``steps[0] < step <= steps[1]``, sorted."""
    seen: list[int] = []
    for r in range(ranks):
        with open(f"{path}.rank{r}") as f:
            for line in f:
                e, step, *ids = map(int, line.split())
                if e == epoch and steps[0] < step <= steps[1]:
                    seen += ids
    return sorted(seen)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous: asked of the kernel,
    not taken from a fixed range, so that tests running side by side (``pytest -n``) do not meet."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(port: int | None = None, processes: int = 2) -> list[str]:
    """The command prefix that launches a script on ``processes`` CPU processes (gloo)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_port", str(free_port() if port is None else port)]


def load_ranks(out: Any, ranks: int) -> list[dict[str, Any]]:
    """What each rank of a training script saved: rank 0 to ``out``, rank r to ``out.rank<r>``."""
    return [torch.load(out if r == 0 else f"{out}.rank{r}", weights_only=False) for r in range(ranks)]


def reference_states(tmp_path_factory: Any, run: Callable[[str, Any], str],
                     ranks: Callable[[str], int]) -> Callable[[str], list[dict[str, Any]]]:
    """For a module-scoped ``reference`` fixture: per configuration, the final state of every
    rank of the uninterrupted loop that never imported diffckpt, trained once and cached.
    ``run(config, out)`` trains it (saving to ``out``) and returns its log."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def get(config: str) -> list[dict[str, Any]]:
        if config not in cache:
            out = tmp_path_factory.mktemp("ref") / "final.pt"
            log = run(config, out)
            assert "diffckpt" not in log
            cache[config] = load_ranks(out, ranks(config))
        return cache[config]
    return get


def assert_bitwise_equal(a: Any, b: Any, path: str = "$") -> None:
    """Recursively compare two states; tensors with ``torch.equal`` (dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{path}: tensors differ (max abs diff {(a.double() - b.double()).abs().max().item()})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b)) if isinstance(b, dict) else b}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), f"{path}: arrays differ"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def count_tensors(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return 1
    if isinstance(state, dict):
        return sum(count_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(count_tensors(v) for v in state)
    return 0


def root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root): a second user, or a tmpfs mount")

