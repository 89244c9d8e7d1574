"""Files one user keeps on this node for the node-local tier and for spools: where they go, how
they are opened, and how to tell whether the process that wrote one still runs.

The temporary folder is shared by every user of the machine, so nothing there is trusted by its
name alone:

- each user's files live in a folder of their own, ``<base>/diffckpt-<uid>``, created with mode
  0700 and checked on every use to be a real folder (not a link) owned by this user and closed to
  others (:func:`private_folder`); a folder that fails the check is refused with an error naming
  it, never used;
- files in it are created exclusively and opened without following links or blocking on FIFOs,
  and one that is not a regular file of this user is not read (:func:`open_private`).

Whether a writer still runs is told by a lock, not by a process id: a writer holds an ``flock``
on its file for as long as it writes (:func:`lock`), the kernel drops it when the process dies
however it dies, and another process sees it (:func:`locked`), in another pid namespace too. A
process id may name another process after a reboot or once reused; where the file system has no
locks, the writer's identity is checked instead: same boot, and a process of that id that
started at the recorded time (:func:`identity`, :func:`running`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from ..errors import StorageError

__all__ = ["free_bytes", "identity", "local_path", "lock", "locked", "memory_backed", "open_private", "private_folder", "running",
           "user_folder"]

try:  # POSIX; elsewhere nothing is locked and every writer counts as running
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


def user_folder(base: str) -> str:
    """This user's folder in ``base`` (a temporary folder, or ``CheckpointOptions.local_dir``)."""
    return os.path.join(base, f"diffckpt-{_uid()}")


def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else 0


def private_folder(path: str, create: bool = True) -> bool:
    """Make sure ``path`` is a folder of this user closed to others: created with mode 0700 where
    missing (``create``), refused where it is a link, not a folder, or another user's. A folder of
    this user open to others is closed (0700). Return whether it exists.

    Raises:
        StorageError: it cannot be created, or is not this user's private folder.
    """
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StorageError(f"cannot create the folder {path}: {exc} (set CheckpointOptions(local_dir=...) "
                               "to a writable folder, or TMPDIR)") from exc
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StorageError(f"cannot read the folder {path}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise StorageError(f"{path} is not a folder (a {'link' if stat.S_ISLNK(st.st_mode) else 'file'}): diffckpt "
                           "keeps each user's files in a folder of their own there and does not follow links; "
                           "remove it, or set CheckpointOptions(local_dir=...) elsewhere")
    if hasattr(os, "geteuid") and st.st_uid != _uid():
        raise StorageError(f"the folder {path} belongs to user {st.st_uid}, not to this user ({_uid()}): someone "
                           "else made it, so nothing in it can be trusted; remove it, or set "
                           "CheckpointOptions(local_dir=...) elsewhere")
    if st.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise StorageError(f"cannot close the folder {path} to other users: {exc}") from exc
    return True


def open_private(path: str, flags: int = os.O_RDONLY, mode: int = 0o600, owner: bool = True) -> int:
    """Open ``path`` without following a link and without blocking on a FIFO; a file that exists
    must be a regular file, of this user unless ``owner`` is false (a spool a journal of the
    user's own names: on a run root on NFS with root squashing, files are not the creator's).
    ``flags`` may add ``O_CREAT | O_EXCL`` to create one (then it is this process's own).

    Raises:
        OSError: as ``os.open``; ``ELOOP`` for a link; ``EPERM`` for another user's file or one
            that is not a regular file.
    """
    extra = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags | extra, mode)
    try:
        st = os.fstat(fd)
        mine = not owner or flags & os.O_EXCL or not hasattr(os, "geteuid") or st.st_uid == _uid()
        if not stat.S_ISREG(st.st_mode) or not mine:
            raise OSError(errno.EPERM, "not a regular file of this user", path)
        if getattr(os, "O_NONBLOCK", 0):  # non-blocking only guarded the open
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock(fd: int, exclusive: bool = True) -> bool | None:
    """Try to lock the open file ``fd`` without waiting: ``True`` locked, ``False`` another open
    file holds a lock on it, ``None`` the file system has no locks. The lock goes with the file's
    close, or with the process."""
    if fcntl is None:  # pragma: no cover - Windows
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return None
        raise
    return True


def locked(path: str) -> bool | None:
    """Whether a writer holds its lock on ``path`` now (``None``: it cannot be told: no locks
    there, or the file cannot be opened; a missing file is not locked)."""
    try:
        fd = open_private(path)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        got = lock(fd, exclusive=False)
        return None if got is None else not got
    finally:
        os.close(fd)  # closing drops the shared lock taken to look


def identity() -> dict[str, str]:
    """This process's identity beyond its id: the boot it runs in and when it started (clock ticks
    since boot), from ``/proc`` (empty where there is none)."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            out["boot"] = f.read().strip()
    start = _start_time(os.getpid())
    if start is not None:
        out["start"] = start
    return out


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after the last ")"
    fields = data[data.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else None


def running(pid: int, ident: dict[str, str]) -> bool:
    """Whether process ``pid`` of identity ``ident`` (:func:`identity`, as its writer recorded it)
    still runs on this node, for a file system without locks: the same boot and a process of that
    id that started at the same time. Without ``/proc``, a process of that id counts."""
    mine = identity()
    if ident.get("boot") and mine.get("boot") and ident["boot"] != mine["boot"]:
        return False  # written before a reboot: every process of that boot is gone
    if ident.get("start") and mine.get("start"):
        return _start_time(pid) == ident["start"]
    if os.name != "posix":  # pragma: no cover - on Windows, os.kill(pid, 0) ends the process
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def local_path(url: str) -> str | None:
    """The directory a local ``url`` names (``None``: a remote store)."""
    if "://" not in url:
        return url
    return url.split("://", 1)[1] if url.startswith(("file://", "local://")) else None


def memory_backed(path: str) -> bool:
    """Whether ``path`` lies on a file system held in memory (``tmpfs``, ``ramfs``: writes run at
    memory speed and outlive a process, not the node), from the mount table of this process
    (Linux; elsewhere ``False``)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            mounts = [line.split()[1:3] for line in fh if len(line.split()) >= 3]
    except OSError:
        return False
    real = os.path.realpath(path)
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind in _MEMORY_FILESYSTEMS


def free_bytes(path: str) -> int:
    """Bytes an unprivileged user may still write in ``path``'s file system (0 if it cannot tell)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:  # a folder not made yet
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize

