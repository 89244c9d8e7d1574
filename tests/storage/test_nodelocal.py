"""The files one user keeps on the node (``diffckpt.storage.nodelocal``): the private folder, safe
opens, locks, and the writer's identity where a file system has no locks. Real files, real
processes; a file system without ``flock`` is the one fault produced by hand (``flock`` raising
``ENOLCK``, as NFS without a lock manager does)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffckpt import StorageError
from diffckpt.journal import JournalWriter
from diffckpt.journalfile import read_journal
from diffckpt.storage import nodelocal
from diffckpt.storage.nodelocal import (
    identity,
    lock,
    locked,
    open_private,
    private_folder,
    running,
    user_folder,
)


def test_the_private_folder_is_made_closed_and_checked(tmp_path: Path) -> None:
    folder = user_folder(str(tmp_path))
    assert private_folder(folder) and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    os.chmod(folder, 0o755)
    assert private_folder(folder, create=False) and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert not private_folder(str(tmp_path / "missing"), create=False)
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(StorageError, match="is not a folder \\(a link\\)"):
        private_folder(str(tmp_path / "link"))
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StorageError, match="is not a folder \\(a file\\)"):
        private_folder(str(tmp_path / "file"))
    if os.geteuid() == 0:  # another user's folder: refused, never closed or used
        other = tmp_path / "theirs"
        other.mkdir(mode=0o777)
        os.chown(other, 65534, 65534)
        with pytest.raises(StorageError, match="belongs to user 65534"):
            private_folder(str(other))


def test_open_private_follows_no_link_and_does_not_block_on_a_fifo(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"data")
    os.close(open_private(str(tmp_path / "f")))
    os.symlink(tmp_path / "f", tmp_path / "l")
    with pytest.raises(OSError) as link:
        open_private(str(tmp_path / "l"))
    assert link.value.errno == errno.ELOOP
    os.mkfifo(tmp_path / "p")
    with pytest.raises(OSError) as fifo:  # returns at once (no writer), refused as not a regular file
        open_private(str(tmp_path / "p"))
    assert fifo.value.errno == errno.EPERM
    with pytest.raises(FileExistsError):
        open_private(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def test_a_lock_is_seen_from_another_process_and_goes_with_it(tmp_path: Path) -> None:
    path = tmp_path / "j"
    path.write_bytes(b"")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(path)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True); time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert locked(str(path)) is True
        fd = os.open(path, os.O_RDONLY)
        assert lock(fd) is False
        os.close(fd)
    finally:
        holder.kill()
        holder.wait()
    assert locked(str(path)) is False  # the kernel let go with the process
    assert locked(str(tmp_path / "absent")) is False


def test_without_locks_the_writers_identity_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = identity()
    assert mine.get("boot") and mine.get("start")  # Linux: /proc has both
    assert running(os.getpid(), mine)
    assert not running(os.getpid(), {**mine, "boot": "another-boot"})  # written before a reboot
    time.sleep(0.05)  # a tick or more after this process started
    other = subprocess.Popen(["sleep", "60"])
    try:  # a live pid that started at another time: as a reused pid is
        assert not running(other.pid, mine)
    finally:
        other.kill()
        other.wait()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not running(int(dead.stdout), mine)

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    writer = JournalWriter(str(tmp_path / "k"), "file:///run", 1, 0, str(tmp_path / "k" / "s.tmp"))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert lock(os.open(writer.path, os.O_RDONLY)) is None and locked(writer.path) is None
    journal = read_journal(writer.path, claim=True)
    assert journal is not None and journal.busy and journal.in_use  # this process still runs
    forged = read_journal(writer.path)
    assert forged is not None
    forged.ident = {**forged.ident, "start": "0"}  # as if another process of that pid wrote it
    assert not forged.in_use
    writer.discard()
    assert nodelocal.fcntl is fcntl
