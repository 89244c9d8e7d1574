"""What every benchmark report shares: the header lines (when, which commit, which machine),
where and how the Markdown report is written, and how bytes on local storage are counted."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
    """Short hash of HEAD, flagged when tracked files have uncommitted changes."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "?"
    return head + (" (uncommitted changes)" if dirty else "")


def header(versions: str, threads_note: str = "") -> list[str]:
    """Date and commit, machine and load, python and torch plus ``versions`` (Markdown bullets)."""
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    now = datetime.datetime.now().isoformat(timespec="seconds")
    return [
        f"- date: {now}, commit {commit()}",
        (f"- machine: {platform.machine()} {platform.processor()}, {os.cpu_count()} cores, "
         f"torch threads {torch.get_num_threads()}{threads_note}, load average before the run {load}"),
        f"- python {platform.python_version()}, torch {torch.__version__}, {versions}",
    ]


def report_path(out: str | None, name: str, quick: bool) -> str:
    """``out`` if given, else ``bench/results/<name>.md`` (``<name>-quick.md`` for a smoke run)."""
    return out or os.path.join(ROOT, "bench", "results", f"{name}-quick.md" if quick else f"{name}.md")


def write_report(path: str, lines: list[str]) -> None:
    """Write a Markdown report, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def dir_usage(path: str) -> tuple[int, int]:
    """``(bytes, files)`` under ``path``, as a storage bill counts them."""
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            total += os.path.getsize(os.path.join(dirpath, name))
            files += 1
    return total, files


def checkout(rev: str, parent: str | None) -> str:
    """The package files at commit ``rev``, extracted into a temp dir (no change to the repo):
    put it first on a process's ``sys.path`` to measure the code before a change."""
    dest = tempfile.mkdtemp(prefix=f"bench-{rev}-", dir=parent)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "diffckpt", "lightning_ckpt"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest
