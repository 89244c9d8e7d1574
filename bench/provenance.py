"""The header lines every benchmark report starts with: when, which commit, which machine."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

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
