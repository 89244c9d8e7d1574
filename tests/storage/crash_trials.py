"""Crash-consistency trials: train in a subprocess, ``kill -9`` it at a chosen or random instant,
then check what is on storage and resume from it (in this process, as a fresh job would).

A trial passes when:
- every committed object passes ``diffckpt verify`` (no torn or partial object is visible);
- the resumed process restores a step at least as new as the last one the killed process
  reported durable, and at most one step newer than the last one it finished (``STEP n``);
- with the node-local tier on (``Trial.local_dir``), it loses at most one step: it restores at
  least the step before the last one it finished, whatever ``write_batch`` and storage, since
  ``record_step(n)`` returns only once the record of step ``n - 1`` is journaled;
- the restored state is bitwise the uninterrupted run's state at that step, and training on from
  it ends bitwise where the uninterrupted run ended (checked inside ``crash_script.py resume``);
- once the resumed run ended, no journal is left in the trial's local folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crash_script
import torch
from helpers import step_of, steps_in, subprocess_env

from diffckpt import cli
from diffckpt.journalfile import read_journal
from diffckpt.storage.nodelocal import user_folder

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_script.py")
STEPS = 40
BASE_EVERY = 10
WRITE_BATCH = 4


@dataclass
class Trial:
    """Where to write and when to kill.

    ``kill``: ``("random", seed)``; ``("pause-before"|"pause-after", regex[, line])`` stops the
    writer around a matching write and kills then (once the process also printed ``line``, if
    given: training has run on as far as it can); ``("proxy", regex, body_bytes)`` holds a
    matching PUT in the fault proxy after that many body bytes (mid-upload) and kills then.
    ``local_dir``: the folder of the node-local tier (``None``: no journal).
    """

    name: str
    url: str
    env: dict[str, str]
    kill: tuple[Any, ...]
    proxy: Any = None  # FaultProxy for ("proxy", ...) kills
    forward_after_kill: bool = False  # let the held request reach S3 after the writer died
    local_dir: str | None = None
    write_batch: int = WRITE_BATCH
    base_every: int = BASE_EVERY
    durability: str = "paced"


@dataclass
class Outcome:
    phase: str
    last_step: int  # the newest step the killed process finished (printed STEP for)
    last_durable: int | None
    restored: int | None
    lines: list[str] = field(default_factory=list)
    journal: bool = False
    backend: str = ""

    @property
    def lost(self) -> int:
        """Steps the killed process finished that the resume did not restore."""
        return max(0, self.last_step - (self.restored or 0))


def truth_file(directory: str) -> str:
    out = os.path.join(directory, "truth.pt")
    if not os.path.exists(out):
        _run(["truth", "--out", out], subprocess_env())
    return out


def _run(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, SCRIPT, *args, "--steps", str(STEPS)], check=False, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _phase(lines: list[str], kill: tuple[Any, ...]) -> str:
    """What the killed process was doing: the write in flight, if any."""
    if kill[0] != "random":
        return f"{kill[0]} {re.sub(r'^/t[0-9]+/', '/', kill[1])}"  # the soak's trials share a bucket
    open_writes: dict[str, None] = {}
    for line in lines:
        if line.startswith("BEGIN "):
            open_writes[line.split()[1]] = None
        elif line.startswith("END "):
            open_writes.pop(line.split()[1], None)
    if not open_writes:
        return "training (no write in flight)"
    path = next(iter(open_writes))
    kind = "segment" if path.startswith("diffs/") else "base COMMIT" if path.endswith("COMMIT") else "base state"
    return f"writing a {kind}"


def journals_left(local_dir: str) -> list[str]:
    """The readable journals under ``local_dir`` (a resume that ended leaves none)."""
    found = []
    for folder, _, names in os.walk(user_folder(local_dir)):
        found += [os.path.join(folder, n) for n in names if n.endswith(".journal")]
    return [p for p in found if read_journal(p) is not None]


def run_trial(trial: Trial, truth: str) -> Outcome:
    settings = ["--write-batch", str(trial.write_batch), "--base-every", str(trial.base_every),
                "--local-dir", trial.local_dir or "none", "--durability", trial.durability]
    args = ["train", "--url", trial.url, *settings]
    handle = None
    kill = trial.kill
    wait_for: set[str] = set()  # the lines to see before the kill (pause-*)
    if kill[0] in ("pause-before", "pause-after"):
        args += [f"--{kill[0]}", kill[1]]
        wait_for = {"PAUSED", *kill[2:]}
    elif kill[0] == "proxy":
        handle = trial.proxy.pause("PUT", kill[1], after_body_bytes=kill[2],
                                   forward_if_client_gone=trial.forward_after_kill)
    rng = random.Random(kill[1]) if kill[0] == "random" else None
    kill_step = rng.randint(1, STEPS - 1) if rng else None
    proc = subprocess.Popen([sys.executable, SCRIPT, *args, "--steps", str(STEPS)], env=trial.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    go = threading.Event()
    seen: set[str] = set()

    def paused(line: str) -> bool:
        line = line.rstrip("\n")
        seen.update(["PAUSED"] if line.startswith("PAUSED ") else [line] if line in wait_for else [])
        return bool(wait_for) and seen == wait_for  # (a proxy's kill waits for its handle)

    when: Callable[[str], bool] = (
        (lambda line: (step := step_of(line)) is not None and step >= kill_step) if kill_step is not None
        else paused)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if when(line):
                if rng is not None:  # a random instant a little after that step
                    threading.Event().wait(rng.uniform(0, 0.03))
                go.set()
        go.set()  # exited on its own: nothing to wait for

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if handle is not None:
        while not handle.reached.wait(0.1) and not go.is_set():
            pass
    else:
        go.wait(120)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    if handle is not None:
        handle.release()
    steps = steps_in("\n".join(lines))
    durable = [int(x.split()[1]) for x in lines if x.startswith("DURABLE ") and x.split()[1] != "None"]
    outcome = Outcome(_phase(lines, kill), max(steps, default=0), max(durable, default=None), None, lines,
                      trial.local_dir is not None, "local" if "://" not in trial.url else trial.url.split("://")[0])
    reached = seen == wait_for if wait_for else handle is None or handle.reached.is_set()
    assert kill[0] == "random" or reached, f"{trial.name}: the kill point was never reached\n" + "\n".join(lines[-20:])
    tracebacks = [i for i, x in enumerate(lines) if x.startswith("Traceback") or x.startswith("Exception in thread")]
    assert not tracebacks, f"{trial.name}: the process failed before the kill ({outcome.phase}):\n" + \
        "\n".join(lines[tracebacks[0]: tracebacks[0] + 80] if tracebacks else [])

    # Checked in this process, which reaches S3 directly (the proxy's faults are over).
    rc, out = _in_process(cli.main, ["verify", trial.url])
    nothing = outcome.last_durable is None and "no committed checkpoint" in out
    assert rc == 0 or nothing, f"{trial.name}: verify failed after the kill ({outcome.phase}):\n{out}"

    rc, resumed = _in_process(crash_script.main, [
        "resume", "--url", trial.url, "--truth", truth, "--steps", str(STEPS), *settings])
    restored = next(int(x.split()[1]) for x in resumed.splitlines() if x.startswith("RESTORED "))
    outcome.restored = restored
    assert "OK" in resumed.splitlines(), resumed[-3000:]
    facts = (trial.name, outcome.phase, "restored", restored, "last step", outcome.last_step, "durable",
             outcome.last_durable)
    if outcome.last_durable is not None:
        assert restored >= outcome.last_durable, facts
    assert restored <= outcome.last_step + 1, facts
    if trial.local_dir is not None:
        assert restored >= outcome.last_step - 1, facts  # at most one step lost
        assert journals_left(trial.local_dir) == [], facts
    return outcome


def _in_process(fn: Callable[[list[str]], Any], argv: list[str]) -> tuple[int, str]:
    """Run ``fn(argv)`` here with its output captured, single-threaded like the subprocesses
    (so the resumed run computes bit for bit like the uninterrupted one)."""
    threads = torch.get_num_threads()
    out = io.StringIO()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = fn(argv)
    finally:
        torch.set_num_threads(threads)
    return int(rc or 0), out.getvalue()


def tally(outcomes: list[Outcome]) -> str:
    """A table of trials per phase at the kill, and of steps lost (finished, not restored)."""
    phases = Counter(o.phase for o in outcomes)
    rows = [f"{len(outcomes)} trials, all restored the newest durable step bit-exactly", "phase at kill:"]
    rows += [f"  {n:4d}  {phase}" for phase, n in phases.most_common()]
    rows.append("steps finished but not restored (lost): trials per count")
    for journal in (True, False):
        for backend in sorted({o.backend for o in outcomes}):
            lost = Counter(o.lost for o in outcomes if o.journal == journal and o.backend == backend)
            if lost:
                rows.append(f"  {backend}, journal {'on' if journal else 'off'}: " +
                            ", ".join(f"{k} lost: {v}" for k, v in sorted(lost.items())))
    return "\n".join(rows)

