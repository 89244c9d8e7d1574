"""Spools (a local file an object's bytes are appended to before the object is written) and reads
by byte range: the spool itself, committing one to local disk (a rename), to ``memory://`` and to
S3 (moto over HTTP, faults from the proxy), through the wrappers and a caller's plain storage;
what a killed writer leaves behind and who removes it."""

from __future__ import annotations

import errno
import mmap
import os
import random
import re
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from faultproxy import FaultProxy
from s3env import S3Target, limit_s3fs_retries
from test_protocol import Plain

from diffckpt import CheckpointNotFoundError, CheckpointOptions, StorageError
from diffckpt.lifecycle.leftovers import details_of, leftovers
from diffckpt.runstore import RunStore
from diffckpt.storage import (
    FsspecStorage,
    InspectableStorage,
    RetryingStorage,
    RetryPolicy,
    Spool,
    as_bytes,
    data_size,
    freespools,
    localwrite,
    open_spool,
    open_storage,
    ranged,
    read_into,
    read_range,
    spoolmap,
    spoolwrite,
)
from diffckpt.storage import fsspec_storage as fsspec_module
from diffckpt.storage import spool as spool_module
from diffckpt.storage.prefixed import Prefixed, substorage
from diffckpt.storage.spool import SPOOL_FOLDER, temporary_spool

MiB = 2**20
HINT = "diffs/000000000012-open.g000001.seg"
USER = f"diffckpt-{os.geteuid()}"  # this user's folder in the temporary folder
FINAL = "diffs/000000000012-000000000020.g000001.seg"
QUICK = RetryPolicy(budget_s=20, initial_backoff_s=0.01, max_backoff_s=0.05)


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Temporary-folder spools of this test go to a folder of its own, not the machine's."""
    folder = tmp_path / "systmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# ------------------------------------------------------------------------------- the spool
def test_append_gives_offsets_and_chunks_read_back_in_order(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path / "s.tmp"))
    floats: Any = memoryview(bytearray(range(16))).cast("f")  # not a byte view: appended as its bytes
    assert spool.append([b"abc", memoryview(b"defgh")]) == 0
    assert spool.append([]) == 8 and spool.append([b""]) == 8
    assert spool.append([floats]) == 8
    many = payload(3000, 1)
    assert spool.append([many[i:i + 1] for i in range(3000)]) == 24  # more buffers than IOV_MAX
    expected = b"abcdefgh" + bytes(range(16)) + many
    assert spool.size == len(expected) == os.path.getsize(spool.path)
    chunks = list(spool.chunks(1000))
    assert [len(c) for c in chunks] == [1000, 1000, 1000, 24] and b"".join(chunks) == expected
    assert b"".join(spool) == expected  # iterating gives the chunks: plain storages can write it
    assert spool.read_at(5, 10) == expected[5:15] and spool.read_at(0, 0) == b""
    with pytest.raises(ValueError):
        spool.read_at(spool.size - 1, 2)
    spool.truncate(8)
    assert spool.append([b"XY"]) == 8 and spool.read_at(0, spool.size) == b"abcdefghXY"
    spool.discard()
    spool.discard()  # idempotent
    assert not os.path.exists(spool.path)


def test_short_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, offset: real(fd, [bytes(bufs[0])[:3]], offset))
    with Spool(str(tmp_path / "s.tmp")) as spool:
        spool.append([b"0123456789", b"", b"abcdefg"])
        assert spool.read_at(0, spool.size) == b"0123456789abcdefg"
        spool.discard()


def test_a_failed_append_leaves_the_spool_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = Spool(str(tmp_path / "s.tmp"))
    spool.append([b"kept"])
    real = os.pwritev
    calls = []

    def full_disk(fd: int, bufs: list[Any], offset: int) -> int:
        calls.append(fd)
        if len(calls) == 1:
            return real(fd, [bufs[0]], offset)  # the first buffer goes out, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full_disk)
    with pytest.raises(StorageError, match="disk is full"):
        spool.append([b"lost-", b"too"])
    monkeypatch.undo()
    assert spool.size == 4 == os.path.getsize(spool.path)
    assert spool.append([b"!"]) == 4 and b"".join(spool.chunks()) == b"kept!"
    spool.discard()


def test_a_spool_is_discarded_when_its_block_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), Spool(str(tmp_path / "s.tmp")) as spool:
        spool.append([b"x"])
        raise RuntimeError("encoding failed")
    assert not os.path.exists(spool.path)
    with Spool(str(tmp_path / "t.tmp")) as kept:
        kept.append([b"x"])
    assert os.path.exists(kept.path)  # a normal end leaves it to the caller (it is to be written)
    kept.discard()


def test_data_size_and_as_bytes(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path / "s.tmp"))
    spool.append([b"abc", b"de"])
    assert data_size(spool) == 5 and as_bytes(spool) == b"abcde"
    assert data_size(b"abc") == 3 and data_size([b"ab", memoryview(b"cde")]) == 5
    doubles: Any = memoryview(bytearray(8)).cast("d")
    assert data_size(doubles) == 8  # bytes, not elements
    assert as_bytes([b"ab", memoryview(b"c")]) == b"abc"
    spool.discard()


# ------------------------------------------------------------------------------- parallel appends
@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> int:
    """Parallel appends from 64 KiB on, in 16 KiB pieces: the threshold and the cuts in reach of
    small payloads. Returns the threshold."""
    monkeypatch.setattr(spoolwrite, "PARALLEL_MIN", 64 * 1024)
    monkeypatch.setattr(spoolwrite, "CHUNK", 16 * 1024)
    return spoolwrite.PARALLEL_MIN


def forced(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """Every append of a spool opened after this goes out from ``workers`` threads."""
    monkeypatch.setattr(spoolwrite.Target, "workers", lambda self, size: workers)


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_parallel_appends_write_the_bytes_of_serial_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_pieces: int, workers: int) -> None:
    chunk = spoolwrite.CHUNK
    batches = [[payload(small_pieces - 1, 1)], [payload(small_pieces, 2)], [payload(small_pieces + 1, 3)],
               [payload(n, 10 + i) for i, n in enumerate([5, chunk - 5, 1, chunk, 3 * chunk + 17, 0, 999])],
               [memoryview(bytearray(range(256)) * 512).cast("f")], [payload(7, 4)]]  # a float view; a small one
    files = {}
    for way in (1, workers):
        forced(monkeypatch, way)
        spool = Spool(str(tmp_path / f"s{way}.tmp"))
        offsets = [spool.append(parts) for parts in batches]
        files[way] = (offsets, spool.size, spool.read_at(0, spool.size))
        spool.discard()
    assert files[workers] == files[1]
    assert files[1][2] == b"".join(bytes(memoryview(p).cast("B")) for parts in batches for p in parts)


def test_a_large_append_goes_the_way_its_file_system_measured_faster(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_pieces: int) -> None:
    monkeypatch.setattr(spoolwrite, "WRITERS", 4)
    monkeypatch.setattr(spoolwrite, "RATED_MIN", 0)  # the pieces here are small
    target = spoolwrite.Target()
    assert target.rate() is None and target.workers(small_pieces - 1) == 1
    ways = []
    for seconds in ([1.0, 1.0], [0.5, 0.5]):  # one thread, then four: twice as fast
        for s in seconds:
            ways.append(target.workers(small_pieces))
            target.note(small_pieces, s, ways[-1])
    later = [target.workers(small_pieces) for _ in range(2 * spoolwrite.RETRIAL)]
    assert later.count(1) == 2 and later[spoolwrite.RETRIAL - 1] == 1  # the slower way, measured again
    for _ in range(12):  # four threads slow down: the measurements follow
        target.note(small_pieces, 4.0, 4)
    assert target.workers(small_pieces) == 1 and target.workers(small_pieces - 1) == 1
    assert target.rate() == pytest.approx(small_pieces / 4.0, rel=0.2)


def test_small_appends_do_not_set_a_file_systems_rate() -> None:
    """A lead, an index or a small record costs its call more than its bytes: counted, a memory
    file system would look slow, and zstd be chosen where it slows the record's path."""
    target = spoolwrite.Target()
    target.note(4096, 0.001, 1)  # 4 MB/s, from a call's cost
    assert target.rate() is None
    target.note(spoolwrite.RATED_MIN, 0.001, 1)
    assert target.rate() == pytest.approx(spoolwrite.RATED_MIN / 0.001)


def test_a_file_system_nothing_was_appended_to_is_measured_on_a_probe(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spoolwrite, "_targets", {})
    spool = Spool(str(tmp_path / "s.tmp"))
    rate = spool.write_rate()
    assert rate is not None and rate > 0
    assert spool.size == 0 == os.path.getsize(spool.path)  # the probe was cut off
    spool.append([b"kept"])
    probes: list[Any] = []
    monkeypatch.setattr(Spool, "append", lambda self, parts: probes.append(parts))
    assert (spool.write_rate() or 0) > 0 and probes == []  # measured: no probe
    other = Spool(str(tmp_path / "t.tmp"))
    assert other.write_rate() == spool.write_rate()  # one figure per file system
    other.discard()
    spool.discard()


def test_a_probe_on_a_full_disk_measures_nothing(small_disk: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spoolwrite, "_targets", {})
    spool = Spool(str(small_disk(0) / "s.tmp"))
    assert spool.write_rate() is None and spool.size == 0
    spool.discard()


def test_a_full_disk_during_a_parallel_append_leaves_the_spool_as_it_was(
        small_disk: Any, monkeypatch: pytest.MonkeyPatch, small_pieces: int) -> None:
    forced(monkeypatch, 4)
    spool = Spool(str(small_disk(64 * 1024) / "s.tmp"))
    spool.append([b"kept"])
    with pytest.raises(StorageError, match="disk is full"):
        spool.append([payload(small_pieces * 4, 1)])  # some pieces fit, the others do not
    assert spool.size == 4 == os.path.getsize(spool.path)
    assert spool.append([b"!"]) == 4 and spool.read_at(0, spool.size) == b"kept!"
    spool.discard()


def test_a_temporary_spool_that_fills_up_in_a_parallel_append_moves_to_memory(
        small_disk: Any, monkeypatch: pytest.MonkeyPatch, small_pieces: int, caplog: pytest.LogCaptureFixture) -> None:
    """A record hashed beside a parallel append that fails: the open segment goes on in memory
    with the same bytes, and its index has the record's checksum."""
    import torch

    from diffckpt.openseg import OpenSegment
    from diffckpt.segment import decode_segment

    forced(monkeypatch, 4)
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk(64 * 1024)))
    grads = torch.randint(0, 2**31 - 1, (1 << 19,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    record = {"step": 1, "prev": 0, "events": [{"grads": [[grads]]}], "state": {}}
    segment = OpenSegment(FsspecStorage("memory://spool-parallel-full"), 1, 0, "none", 1)
    assert segment.spool.temporary and not segment.spool.anonymous
    segment.add(record)  # 2 MiB: hashed beside its append, which the disk cannot take
    assert segment.spool.anonymous and "kept in memory" in caplog.text
    segment.finish(1)
    _, decoded, problem = decode_segment(segment.spool.read_at(0, segment.spool.size))
    assert problem is None and torch.equal(decoded[0]["events"][0]["grads"][0][0], grads)
    segment.discard()


# ------------------------------------------------------------------------------- local disk
def test_a_local_spool_lives_beside_its_target_and_is_committed_by_a_rename(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = FsspecStorage(str(tmp_path / "run"))
    spool = storage.spool(HINT)
    assert os.path.dirname(spool.path) == str(tmp_path / "run" / "diffs") and not spool.temporary
    assert re.fullmatch(r"\.000000000012-open\.g000001\.seg\.[0-9a-f]{8}\.tmp", os.path.basename(spool.path))
    data = payload(100_000)
    spool.append([data[:10], data[10:]])
    assert storage.list("") == {}  # a hidden file: no reader sees it
    inode = os.stat(spool.path).st_ino
    synced: list[os.stat_result] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    storage.write(FINAL, spool)
    target = tmp_path / "run" / FINAL
    assert not os.path.exists(spool.path) and os.stat(target).st_ino == inode  # renamed, not copied
    assert [s.st_ino for s in synced] == [inode, os.stat(target.parent).st_ino]  # file, then directory
    assert stat.S_ISDIR(synced[1].st_mode)
    spool.discard()  # fine after the rename consumed the file
    assert storage.read(FINAL) == data and storage.list("") == {FINAL: len(data)}
    assert sorted(os.listdir(target.parent)) == [target.name]


def test_a_spool_left_by_a_killed_writer_is_a_leftover_that_gc_finds(
        tmp_path: Path, python_env: dict[str, str], python_exe: str) -> None:
    root = str(tmp_path / "run")
    script = ("import os, signal, sys\nfrom diffckpt.storage import FsspecStorage\n"
              f"spool = FsspecStorage(sys.argv[1]).spool({HINT!r})\nspool.append([b'x' * 1000])\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([python_exe, "-c", script, root], env=python_env, capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr
    storage = FsspecStorage(root)
    assert storage.list("") == {}
    (name, (size, _)), = storage.details("", hidden=True).items()
    assert re.fullmatch(r"diffs/\.000000000012-open\.g000001\.seg\.[0-9a-f]{8}\.tmp", name) and size == 1000
    store = RunStore(storage)
    found = leftovers(store, details_of(store), set(), cutoff=time.time() + 60)
    assert [(x.path, x.size, x.kind) for x in found] == [(name, 1000, "temporary file of an interrupted write")]
    assert leftovers(store, details_of(store), set(), cutoff=time.time() - 3600) == []  # too young


def test_a_local_commit_copies_a_spool_on_another_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = FsspecStorage(str(tmp_path / "run"))
    spool = storage.spool(HINT)
    data = payload(50_000)
    spool.append([data])
    real_replace = os.replace
    refused: list[str] = []

    def replace(src: str, dst: str) -> None:
        if not refused:
            refused.append(src)
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    storage.write(FINAL, spool)
    assert refused == [spool.path] and os.path.exists(spool.path)  # copied: the spool is still there
    assert storage.read(FINAL) == data
    spool.discard()
    assert os.listdir(tmp_path / "run" / "diffs") == [os.path.basename(FINAL)]


def test_a_retried_local_commit_copies_what_the_first_attempt_renamed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = RetryingStorage(FsspecStorage(str(tmp_path / "run")), QUICK)
    spool = storage.spool(HINT)
    data = payload(20_000)
    spool.append([data])
    real = fsspec_module._fsync_directory
    failed: list[str] = []

    def flaky(directory: str) -> None:  # the rename happened, then the directory's fsync timed out
        if not failed:
            failed.append(directory)
            raise OSError(errno.ETIMEDOUT, "timed out")
        real(directory)

    monkeypatch.setattr(fsspec_module, "_fsync_directory", flaky)
    storage.write(FINAL, spool)
    assert failed and storage.read(FINAL) == data
    spool.discard()


def test_a_temporary_spool_is_copied_to_a_local_root_with_the_usual_permissions(
        tmp_path: Path, private_tmpdir: Path) -> None:
    storage = FsspecStorage(str(tmp_path / "run"))
    spool = temporary_spool(HINT)
    assert spool.temporary and stat.S_IMODE(os.stat(spool.path).st_mode) == 0o600
    spool.append([b"bytes"])
    storage.write(FINAL, spool)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "run" / FINAL).st_mode) == 0o666 & ~umask
    assert os.path.exists(spool.path) and storage.read(FINAL) == b"bytes"
    spool.discard()  # kept for the next spool to write over (KEEP_FREE), until its writer ends
    assert [n.endswith("-free.tmp") for n in os.listdir(private_tmpdir / USER / SPOOL_FOLDER)] == [True]
    spool_module.release_free_spools()
    assert os.listdir(private_tmpdir / USER / SPOOL_FOLDER) == []


def _advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The ranges the local writes ask the kernel to write back (the real call is made)."""
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        calls.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    return calls


@pytest.mark.parametrize("sendfile", ["kernel", "refused"])
def test_a_spool_copied_to_a_local_root_starts_its_writeback_as_it_goes(
        tmp_path: Path, private_tmpdir: Path, monkeypatch: pytest.MonkeyPatch, sendfile: str) -> None:
    # A temporary spool is copied (in the kernel where sendfile can, else through the process),
    # in pieces smaller than the spool, the writeback of each 64 KiB started behind the copy.
    monkeypatch.setattr(localwrite, "WRITEBACK_EVERY", 64 << 10)
    monkeypatch.setattr(localwrite, "_SEND", 40 << 10)
    sent: list[int] = []
    real_send = os.sendfile

    def send(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        if sendfile == "refused":
            raise OSError(errno.EINVAL, "Invalid argument")
        sent.append(count)
        return real_send(out_fd, in_fd, offset, count)

    monkeypatch.setattr(os, "sendfile", send)
    advised = _advised(monkeypatch)
    storage = FsspecStorage(str(tmp_path / "run"))
    spool = temporary_spool(HINT)
    data = payload(300_000)
    spool.append([data[:100_000], data[100_000:]])
    storage.write(FINAL, spool)
    assert storage.read(FINAL) == data
    assert len(sent) == (8 if sendfile == "kernel" else 0)  # 300,000 bytes in 40 KiB pieces
    assert [o for o, _ in advised] == sorted({o for o, _ in advised}) and advised[0][0] == 0
    # behind the copy: what fsync is left to write is less than an interval and a piece
    assert 0 <= len(data) - sum(n for _, n in advised) < (64 << 10) + (40 << 10)
    spool.discard()


def test_a_base_written_to_a_local_root_from_buffers_starts_its_writeback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localwrite, "WRITEBACK_EVERY", 64 << 10)
    advised = _advised(monkeypatch)
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, view: real_write(fd, view[:50_000]))  # short writes
    storage = FsspecStorage(str(tmp_path / "run"))
    data = payload(200_000)
    storage.write(FINAL, [data[:1], memoryview(data)[1:150_000], data[150_000:]])
    assert storage.read(FINAL) == data and advised and advised[0][0] == 0


@pytest.mark.parametrize("sendfile", ["kernel", "refused"])
def test_a_spool_copied_to_a_full_disk_names_it_and_leaves_nothing(
        small_disk: Any, private_tmpdir: Path, monkeypatch: pytest.MonkeyPatch, sendfile: str) -> None:
    def refuse(*_: Any) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    if sendfile == "refused":  # the copy goes through the process
        monkeypatch.setattr(os, "sendfile", refuse)
    disk = small_disk(64 * 1024)
    storage = FsspecStorage(str(disk / "run"))
    spool = temporary_spool(HINT)
    spool.append([payload(200_000)])  # three times what the disk has free
    with pytest.raises(StorageError, match="the disk is full"):
        storage.write(FINAL, spool)
    assert not storage.exists(FINAL) and os.listdir(disk / "run" / "diffs") == []  # no temporary file left
    assert spool.read_at(0, spool.size) == payload(200_000)  # the spool keeps the bytes for a retry
    spool.discard()


def test_a_spool_whose_file_was_cut_short_is_not_committed(
        tmp_path: Path, private_tmpdir: Path) -> None:
    storage = FsspecStorage(str(tmp_path / "run"))
    spool = temporary_spool(HINT)
    spool.append([payload(100_000)])
    os.truncate(spool.path, 60_000)  # someone cut the file the spool's bytes were in
    with pytest.raises(StorageError, match="ends at byte 60000"):
        storage.write(FINAL, spool)
    assert not storage.exists(FINAL) and os.listdir(tmp_path / "run" / "diffs") == []
    spool.discard()


def test_wrappers_spool_beside_the_target_of_their_folder(tmp_path: Path) -> None:
    root = FsspecStorage(str(tmp_path / "run"))
    for storage in (Prefixed(root, "ranks/r1/"), substorage(open_storage(root), "ranks/r1/")):
        spool = open_spool(storage, HINT)  # their own spool(), which places it
        assert os.path.dirname(spool.path) == str(tmp_path / "run" / "ranks" / "r1" / "diffs")
        spool.append([b"rank one"])
        storage.write(FINAL, spool)
        spool.discard()
        assert root.read("ranks/r1/" + FINAL) == b"rank one" and storage.read(FINAL) == b"rank one"
    assert isinstance(Prefixed(root, "a/"), InspectableStorage)
    assert isinstance(open_storage(root), InspectableStorage)
    assert not isinstance(open_storage(Plain()), InspectableStorage)


# ------------------------------------------------------------------------------- object stores
@pytest.fixture
def memory_url() -> Iterator[str]:
    url = f"memory://spool-{uuid.uuid4().hex[:8]}/run"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


class Watched:
    """Records the largest chunk a spool's content was read in (the memory a commit holds)."""

    def __init__(self, spool: Spool) -> None:
        self.largest = 0
        real = spool.chunks

        def chunks(size: int = 8 << 20) -> Iterator[bytes]:
            for chunk in real(size):
                self.largest = max(self.largest, len(chunk))
                yield chunk

        spool.chunks = chunks  # type: ignore[method-assign]


def _commit(storage: Any, path: str, data: bytes) -> Spool:
    spool = open_spool(storage, path + ".open")
    spool.append([data[: len(data) // 3], data[len(data) // 3:]])
    storage.write(path, spool)
    return spool


def test_memory_root_commits_small_and_streamed_spools(memory_url: str, private_tmpdir: Path) -> None:
    storage = FsspecStorage(memory_url, part_size=1 * MiB, multipart_threshold=2 * MiB)
    small, big = payload(MiB, 1), payload(5 * MiB + 7, 2)
    spool = _commit(storage, "diffs/small.seg", small)
    assert spool.temporary and spool.path.startswith(str(private_tmpdir / USER / SPOOL_FOLDER))
    assert os.path.exists(spool.path)  # an upload leaves the spool to the caller
    spool.discard()
    spool = open_spool(storage, HINT)
    spool.append([big])
    watched = Watched(spool)
    storage.write(FINAL, spool)
    spool.discard()
    assert watched.largest == MiB  # streamed a part at a time, never read whole
    assert storage.read("diffs/small.seg") == small and storage.read(FINAL) == big
    spool_module.release_free_spools()  # the big spool wrote over the small one's file, kept since
    assert os.listdir(private_tmpdir / USER / SPOOL_FOLDER) == []


def test_memory_root_writes_no_object_when_the_spool_cannot_be_read(memory_url: str) -> None:
    storage = FsspecStorage(memory_url, part_size=1 * MiB, multipart_threshold=2 * MiB)
    for size in (MiB, 3 * MiB):
        spool = open_spool(storage, HINT)
        spool.append([payload(size)])
        os.truncate(spool.path, size // 2)  # the local file lost its end: nothing may be committed
        with pytest.raises(StorageError, match="ends at byte"):
            storage.write(FINAL, spool)
        spool.discard()
        assert not storage.exists(FINAL) and storage.list("") == {}


def s3_storage(target: S3Target, **kwargs: Any) -> FsspecStorage:
    return FsspecStorage(target.url, part_size=5 * MiB, multipart_threshold=5 * MiB, **kwargs,
                         **target.storage_options)


def _uploads(target: S3Target) -> list[Any]:
    return target.fs().call_s3("list_multipart_uploads", Bucket=target.bucket).get("Uploads", [])


def test_s3_commits_small_and_multipart_spools(s3_via_proxy: S3Target, s3_bucket: S3Target,
                                               fault_proxy: FaultProxy) -> None:
    storage = s3_storage(s3_via_proxy)
    small, big = payload(MiB, 3), payload(12 * MiB + 5, 4)
    _commit(storage, "diffs/small.seg", small).discard()
    assert fault_proxy.count("PUT", r"/run/diffs/small\.seg$", outcome=200) == 1
    spool = open_spool(storage, HINT)
    spool.append([big])
    watched = Watched(spool)
    storage.write(FINAL, spool)
    spool.discard()
    assert watched.largest == 5 * MiB
    assert fault_proxy.count("POST", r"\?uploads") == 1 and fault_proxy.count("PUT", r"partNumber=") == 3
    direct = s3_storage(s3_bucket)
    assert direct.read("diffs/small.seg") == small and direct.read(FINAL) == big


def test_s3_failed_uploads_leave_no_object_and_retries_reread_the_spool(
        s3_via_proxy: S3Target, s3_bucket: S3Target, fault_proxy: FaultProxy,
        monkeypatch: pytest.MonkeyPatch) -> None:
    limit_s3fs_retries(monkeypatch)
    storage, direct = s3_storage(s3_via_proxy), s3_storage(s3_bucket)
    small, big = payload(MiB, 5), payload(11 * MiB, 6)
    for data, regex in ((small, r"/run/diffs/"), (big, r"partNumber=2")):
        spool = open_spool(storage, HINT)
        spool.append([data])
        fault_proxy.fail(1, status=500, method="PUT", path_regex=regex)
        with pytest.raises(StorageError):
            storage.write(FINAL, spool)
        assert not direct.exists(FINAL) and _uploads(s3_bucket) == []  # the upload was aborted
        fault_proxy.fail(1, status=500, method="PUT", path_regex=regex)
        RetryingStorage(storage, QUICK).write(FINAL, spool)  # the second attempt reads it again
        spool.discard()
        assert direct.read(FINAL) == data
        direct.delete(FINAL)
    assert fault_proxy.count("PUT", outcome="failed") == 4


# ------------------------------------------------------------------------------- ranges
@pytest.fixture(params=["local", "memory", "s3"])
def ranged_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FsspecStorage]:
    if request.param == "local":
        yield FsspecStorage(str(tmp_path / "run"))
    elif request.param == "memory":
        url = request.getfixturevalue("memory_url")
        yield FsspecStorage(url)
    else:
        yield s3_storage(request.getfixturevalue("s3_bucket"))


def test_read_range_on_each_root_and_through_the_wrappers(ranged_root: FsspecStorage) -> None:
    data = payload(1000, 7)
    ranged_root.write("a/x", data)
    views: dict[str, tuple[Any, str]] = {"plain": (ranged_root, "a/x"), "retrying": (open_storage(ranged_root), "a/x"),
             "prefixed": (Prefixed(ranged_root, "a/"), "x"),
             "substorage": (substorage(open_storage(ranged_root), "a/"), "x")}
    for name, (storage, path) in views.items():
        assert ranged(storage), name
        for start, end in ((0, 10), (10, 500), (990, 1000), (990, 1200), (1000, 1010), (1200, 1300), (5, 5)):
            assert read_range(storage, path, start, end) == data[start:end], (name, start, end)
            assert storage.read_range(path, start, end) == data[start:end]
        with pytest.raises(CheckpointNotFoundError):
            read_range(storage, path + "-missing", 0, 10)
        with pytest.raises(CheckpointNotFoundError):
            read_range(storage, path + "-missing", 3, 3)
        with pytest.raises(ValueError):
            read_range(storage, path, 5, 4)
        for start, length in ((0, 10), (10, 490), (990, 10), (990, 210), (1000, 10), (1200, 5), (5, 0)):
            out = bytearray(b"\xee" * length)  # reads into the caller's memory; fewer bytes past the end
            got = read_into(storage, path, start, memoryview(out))
            assert bytes(out[:got]) == data[start : start + length], (name, start, length)
            assert out[got:] == b"\xee" * (length - got)
        with pytest.raises(CheckpointNotFoundError):
            read_into(storage, path + "-missing", 0, memoryview(bytearray(10)))


def test_read_range_of_a_storage_without_ranges_reads_the_whole_object() -> None:
    plain = Plain()
    plain.objects["a/x"] = b"0123456789"
    views = [(plain, "a/x"), (open_storage(plain), "a/x"), (Prefixed(plain, "a/"), "x"),
             (substorage(open_storage(plain), "a/"), "x")]
    for storage, path in views:
        assert not ranged(storage)
        assert read_range(storage, path, 2, 5) == b"234"
        out = bytearray(4)
        assert read_into(storage, path, 8, memoryview(out)) == 2 and out[:2] == b"89"
        # as its read does: the caller's FileNotFoundError, which open_storage's wrapper explains
        missing = CheckpointNotFoundError if isinstance(storage, RetryingStorage) else FileNotFoundError
        with pytest.raises(missing):
            read_range(storage, path + "-missing", 0, 1)
    assert ranged(FsspecStorage("memory://unused")) and not ranged(object())


def test_a_storage_without_spools_writes_a_temporary_one(private_tmpdir: Path) -> None:
    plain = Plain()
    for storage in (plain, open_storage(plain), Prefixed(plain, "r/")):
        spool = open_spool(storage, HINT)
        assert spool.temporary and os.path.dirname(spool.path) == str(private_tmpdir / USER / SPOOL_FOLDER)
        spool.append([b"ab", b"cd"])
        storage.write(FINAL, spool)  # joined by the caller's storage, through the wrappers
        spool.discard()
    assert plain.objects == {FINAL: b"abcd", "r/" + FINAL: b"abcd"}


# ------------------------------------------------------------------------------- the temporary folder
def test_opening_a_temporary_spool_removes_those_no_process_holds(
        private_tmpdir: Path, python_env: dict[str, str], python_exe: str) -> None:
    """A spool is locked while open: the one of an ended process goes, even when its name's pid
    now names a running process (a reused pid); a running process's stays."""
    script = ("import sys, time\nfrom diffckpt.storage.spool import temporary_spool\n"
              "spool = temporary_spool('diffs/a.seg')\nspool.append([b'x' * 100])\nprint(spool.path, flush=True)\n"
              "if sys.argv[1:] == ['hold']:\n    time.sleep(120)\n")
    env = {**python_env, "TMPDIR": str(private_tmpdir)}
    dead = subprocess.run([python_exe, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    left = dead.stdout.strip()
    folder = private_tmpdir / USER / SPOOL_FOLDER
    assert dead.returncode == 0 and os.path.dirname(left) == str(folder), dead.stderr
    assert re.fullmatch(r"\d+-[0-9a-f]{8}-a\.seg\.tmp", os.path.basename(left))
    reused = folder / f"{os.getpid()}-0badcafe-b.seg.tmp"  # a dead spool whose pid names a live process
    os.rename(left, reused)
    reused_too = folder / f"{os.getppid()}-0badcafe-c.seg.tmp"
    reused_too.write_bytes(b"y")
    live = subprocess.Popen([python_exe, "-c", script, "hold"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout is not None
        of_live = live.stdout.readline().strip()
        assert not reused.exists() and not reused_too.exists()  # swept by the live process's first spool
        unrelated = folder / "notes.txt"
        unrelated.write_bytes(b"z")
        mine = temporary_spool("diffs/we ird:name.seg")
        assert os.path.basename(mine.path).endswith("-we_ird_name.seg.tmp")
        assert os.path.exists(of_live) and unrelated.exists()
        again = temporary_spool("diffs/c.seg")  # this process's own spools are kept
        assert os.path.exists(mine.path)
    finally:
        live.kill()
        live.wait()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # this user's only
    assert stat.S_IMODE(os.stat(folder.parent).st_mode) == 0o700
    mine.discard()
    again.discard()


def test_a_temporary_spool_that_cannot_be_created_says_where(private_tmpdir: Path) -> None:
    (private_tmpdir / USER).mkdir(mode=0o700)
    (private_tmpdir / USER / SPOOL_FOLDER).write_bytes(b"a file where the folder should be")
    with pytest.raises(StorageError, match=f"spool file {re.escape(str(private_tmpdir / USER / SPOOL_FOLDER))}"):
        spool_module.temporary_spool(HINT)


# ------------------------------------------------------------------------------- reuse of discarded spools
def test_the_next_temporary_spool_writes_over_a_discarded_ones_file(tmp_path: Path) -> None:
    """Its pages are not allocated again (spool.KEEP_FREE); the bytes before are not read as its own,
    and the discarded spool's object, discarded again, leaves the new one alone."""
    folder = str(tmp_path / "tier")
    first = temporary_spool(HINT, folder)
    first.append([payload(5000)])
    inode = os.stat(first.path).st_ino
    first.discard()
    assert not os.path.exists(first.path)
    assert [re.fullmatch(rf"{os.getpid()}-[0-9a-f]{{8}}-free\.tmp", n) is not None for n in os.listdir(folder)] == [True]
    second = temporary_spool(HINT, folder)
    assert os.stat(second.path).st_ino == inode and second.size == 0 and second.path != first.path
    assert second.append([b"ab", b"cd"]) == 0 and second.append([b"ef"]) == 4
    first.discard()  # again: it no longer holds the file
    assert b"".join(second.chunks()) == b"abcdef" and second.read_at(2, 4) == b"cdef"
    with pytest.raises(ValueError):
        second.read_at(4, 3)  # what the first one wrote past the second's end is not the second's
    elsewhere = temporary_spool(HINT, str(tmp_path / "other"))  # another folder: a file of its own
    assert os.stat(elsewhere.path).st_ino != inode
    for spool in (second, elsewhere):
        spool.discard()
    spool_module.release_free_spools()
    assert os.listdir(folder) == [] and os.listdir(tmp_path / "other") == []


def test_discarded_spools_are_kept_within_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = str(tmp_path / "tier")
    spools = [temporary_spool(HINT, folder) for _ in range(spool_module.KEEP_FREE + 2)]
    for spool in spools:
        spool.append([b"x" * 100])
    empty = temporary_spool(HINT, folder)
    empty.discard()  # nothing to reuse
    for spool in spools:
        spool.discard()
    assert len(os.listdir(folder)) == spool_module.KEEP_FREE  # the rest removed
    spool_module.release_free_spools(folder)
    monkeypatch.setattr(freespools, "free_bytes", lambda path: 399)  # less than 4 times its size
    tight = temporary_spool(HINT, folder)
    tight.append([b"x" * 100])
    tight.discard()
    assert os.listdir(folder) == []
    beside = Spool(str(tmp_path / "beside.tmp"))  # a spool beside its object (a rename commits it) is not kept
    beside.append([b"x"])
    beside.discard()
    assert not os.path.exists(tmp_path / "beside.tmp") and freespools._free.get(str(tmp_path), []) == []


def test_a_forked_child_does_not_take_its_parents_kept_spool(tmp_path: Path) -> None:
    folder = str(tmp_path / "tier")
    spool = temporary_spool(HINT, folder)
    spool.append([b"parent's"])
    spool.discard()
    (kept,) = os.listdir(folder)
    inode = os.stat(os.path.join(folder, kept)).st_ino
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a spool of its own, the parent's kept file untouched
        try:
            mine = temporary_spool(HINT, folder)
            fresh = os.stat(mine.path).st_ino != os.stat(os.path.join(folder, kept)).st_ino
            spool_module.release_free_spools()
            os.write(write, b"ok" if fresh and os.path.exists(os.path.join(folder, kept)) else b"no")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 2) == b"ok"
    os.waitpid(pid, 0)
    again = temporary_spool(HINT, folder)  # still the parent's to reuse
    assert os.stat(again.path).st_ino == inode and kept not in os.listdir(folder)
    again.discard()
    spool_module.release_free_spools()


# ------------------------------------------------------------------------------- appends into the mapping
@pytest.fixture
def mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Appends of any size may go into a mapping, in windows of two pages and pieces of one, so
    that a few small appends cross windows and run on several threads."""
    if not spoolmap.MAPPABLE:
        pytest.skip("no MAP_POPULATE here")
    monkeypatch.setattr(spoolmap, "WINDOW", 2 * mmap.PAGESIZE)
    monkeypatch.setattr(spool_module, "MAP_MIN", 1)
    monkeypatch.setattr(spool_module, "AHEAD", 2)  # what a machine with cores to spare does
    monkeypatch.setattr(spoolmap, "AHEAD", 2)
    monkeypatch.setattr(spoolwrite, "CHUNK", mmap.PAGESIZE)


def written(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the appends that went to ``pwritev`` from now on."""
    sizes: list[int] = []
    real = spool_module.write_at

    def counted(fd: int, views: list[memoryview], offset: int, workers: int = 1) -> int:
        sizes.append(sum(v.nbytes for v in views))
        return real(fd, views, offset, workers)

    monkeypatch.setattr(spool_module, "write_at", counted)
    return sizes


def test_appends_into_pages_allocated_ahead_are_copied_into_the_mapping(
        tmp_path: Path, mapped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new file's first append is written; the pages of the next two of its size are allocated
    and mapped beside it, and those appends are copies. A kept file's mapping goes along."""
    folder, window = str(tmp_path / "tier"), spoolmap.WINDOW
    sizes = written(monkeypatch)
    spool = temporary_spool(HINT, folder)
    expected = b""
    for parts in ([payload(10000, seed=1)], [payload(5000, seed=2), b"", b"xyz"], [payload(12000, seed=3)],
                  [payload(60000, seed=4)], [payload(9000, seed=5)]):
        assert spool.append(parts) == len(expected)
        expected += b"".join(parts)
        assert spool._map is not None
        spool._map.settle()
        assert spool._map.allocated >= len(expected) + spoolmap.AHEAD * sum(map(len, parts)) > len(expected)
        assert spool._map.allocated % window == 0 and os.stat(spool.path).st_size == spool._map.allocated
    assert sizes == [10000, 60000]  # the first, and one larger than the pages allocated ahead
    assert spool.read_at(0, spool.size) == expected == b"".join(spool.chunks())
    spool.truncate(7)  # cut back (a failed record): the pages past it are gone, and written again
    assert spool._map.allocated == 7 and spool.append([payload(40000, seed=9)]) == 7 and sizes[-1] == 40000
    expected = expected[:7] + payload(40000, seed=9)
    assert spool.read_at(0, spool.size) == expected
    spool._map.settle()
    spool.discard()
    again = temporary_spool(HINT, folder)  # the same file and mapping: nothing written
    again.append([b"abc", payload(100000, seed=3)])
    assert again.read_at(0, again.size) == b"abc" + payload(100000, seed=3) and len(sizes) == 3
    again.discard()
    spool_module.release_free_spools()
    assert os.listdir(folder) == []
    beside = Spool(str(tmp_path / "beside.tmp"))  # not in diffckpt's own folders (renamed to its object): written
    beside.append([payload(9000)])
    assert beside._map is None and beside.read_at(0, 9000) == payload(9000) and sizes[-1] == 9000
    beside.discard()


def test_a_full_file_system_stops_the_allocation_ahead_and_fails_the_append_that_needs_pages(
        tmp_path: Path, mapped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No page is ever touched through the mapping that the file system did not allocate: a full
    file system is an ENOSPC of the write that needs the pages (a SIGBUS would kill the process)."""
    spool = temporary_spool(HINT, str(tmp_path / "tier"))
    spool.append([payload(10000, seed=1)])
    assert spool._map is not None
    spool._map.settle()
    ahead = spool._map.allocated

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spoolmap.os, "posix_fallocate", full)
    real = spool_module.write_at

    def no_room(fd: int, views: list[memoryview], offset: int, workers: int = 1) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    spool.append([payload(ahead - 10000, seed=2)])  # into the pages there: copied
    spool._map.settle()
    assert spool._map.allocated == ahead
    monkeypatch.setattr(spool_module, "write_at", no_room)
    with pytest.raises(StorageError, match="disk is full"):
        spool.append([payload(5000, seed=3)])
    assert spool.size == ahead and spool.read_at(0, ahead) == payload(10000, seed=1) + payload(ahead - 10000, seed=2)
    monkeypatch.setattr(spool_module, "write_at", real)
    spool.discard()
    spool_module.release_free_spools()


def test_a_mapping_that_fails_leaves_the_append_to_pwritev(
        tmp_path: Path, mapped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = str(tmp_path / "tier")
    first = temporary_spool(HINT, folder)
    first.append([payload(20000)])
    first.discard()
    spool = temporary_spool(HINT, folder)

    def no_room(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(spoolmap.mmap, "mmap", no_room)
    assert spool.append([payload(15000, seed=2)]) == 0
    assert spool._map is None and spool.read_at(0, 15000) == payload(15000, seed=2)
    spool.discard()
    spool_module.release_free_spools()


def fills_done(folder: str) -> None:
    deadline = time.monotonic() + 30
    while freespools._filling.get(folder, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not freespools._filling.get(folder, 0)


def free_files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith("-free.tmp"))


@pytest.fixture
def spare(mapped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with cores to spare: the next spools' files are allocated ahead."""
    monkeypatch.setattr(spoolmap, "SPARE_CORES", True)
    monkeypatch.setattr(freespools, "MAP_MIN", 1)


def test_the_next_spools_file_is_allocated_and_mapped_ahead(
        tmp_path: Path, spare: None, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = str(tmp_path / "tier")
    sizes = written(monkeypatch)
    first = temporary_spool(HINT, folder)  # nothing seen in this folder yet: nothing allocated ahead
    first.append([payload(30000, seed=1)])
    fills_done(folder)
    assert free_files(folder) == [] and sizes == [30000]
    second = temporary_spool(HINT, folder)  # opens a new file, and has the next one made
    fills_done(folder)
    (made,) = free_files(folder)
    assert os.stat(os.path.join(folder, made)).st_size == 30000
    third = temporary_spool(HINT, folder)  # takes it: its records are copies
    assert third._map is not None and third._map.allocated == 30000 and len(third._map._windows) == -(-30000 // spoolmap.WINDOW)
    third.append([payload(20000, seed=2)])
    third.append([payload(10000, seed=3)])
    assert sizes == [30000] and third.read_at(0, 30000) == payload(20000, seed=2) + payload(10000, seed=3)
    fills_done(folder)
    assert len(free_files(folder)) == 1  # the one for the spool after it
    for spool in (first, second, third):
        spool.discard()
    assert len(free_files(folder)) == spool_module.KEEP_FREE  # discarded ones kept within the bound
    spool_module.release_free_spools(folder)
    assert os.listdir(folder) == []


def test_allocating_ahead_stops_on_a_full_file_system_and_at_release(
        tmp_path: Path, spare: None, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = str(tmp_path / "tier")
    first = temporary_spool(HINT, folder)
    first.append([payload(30000)])

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(spoolmap.os, "posix_fallocate", full)
        second = temporary_spool(HINT, folder)
        fills_done(folder)
    assert free_files(folder) == [] and len(os.listdir(folder)) == 2  # the two spools: nothing left over
    third = temporary_spool(HINT, folder)
    spool_module.release_free_spools(folder)  # a writer ends while a file is made: it goes too
    fills_done(folder)
    assert free_files(folder) == []
    for spool in (first, second, third):
        spool.discard()
    spool_module.release_free_spools(folder)
    assert os.listdir(folder) == []


def test_nothing_is_allocated_ahead_without_a_spare_core(tmp_path: Path, mapped: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spoolmap, "SPARE_CORES", False)  # the 2-core VM (and CI)
    monkeypatch.setattr(freespools, "MAP_MIN", 1)
    folder = str(tmp_path / "tier")
    first = temporary_spool(HINT, folder)
    first.append([payload(30000)])
    second = temporary_spool(HINT, folder)
    fills_done(folder)
    assert free_files(folder) == []
    for spool in (first, second):
        spool.discard()
    spool_module.release_free_spools(folder)


def test_a_run_whose_records_go_into_files_allocated_ahead_restores_every_step_bitwise(
        tmp_path: Path, spare: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine end to end with the node-local tier's spools copied into mapped files made
    ahead (an object store's run root keeps its spools in the tier), every step restored."""
    from engine_runs import assert_state, restore, train

    copies = []
    real = spoolmap.FileMap.write

    def counted(self: spoolmap.FileMap, views: list[memoryview], offset: int) -> int:
        copies.append(offset)
        return real(self, views, offset)

    monkeypatch.setattr(spoolmap.FileMap, "write", counted)
    root, tier = f"memory://filled-{uuid.uuid4().hex}", str(tmp_path / "tier")
    truth, durable = train(root, steps=13, write_batch=3, local_dir=tier)
    assert durable == 13 and len(copies) >= 6  # most records after the first segment's first: copies
    for step in (4, 9, 13):
        result, module, optimizers = restore(root, step, options=CheckpointOptions(local_dir=tier))
        assert_state(truth, result, module, optimizers)
    spool_module.release_free_spools()
    assert [n for n in os.listdir(tier) if n.endswith(".tmp")] == []


def test_usable_cores_are_the_affinity_or_the_containers_quota(tmp_path: Path) -> None:
    mask = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    quota.write_text("max 100000\n")  # no quota
    assert spoolmap.usable_cores(str(quota)) == mask
    quota.write_text("150000 100000\n")  # one and a half cores
    assert spoolmap.usable_cores(str(quota)) == min(mask, 1.5)
    assert spoolmap.usable_cores(str(tmp_path / "none")) == mask  # no cgroup v2


@pytest.mark.parametrize(("value", "spare"), [("1", True), ("0", False)])
def test_allocating_ahead_is_forced_on_or_off_by_the_environment(value: str, spare: bool) -> None:
    env = dict(os.environ, DIFFCKPT_ALLOCATE_AHEAD=value)
    done = subprocess.run([sys.executable, "-c", "from diffckpt.storage import spoolmap; "
                           "print(spoolmap.SPARE_CORES, spoolmap.AHEAD)"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == [str(spare), "2" if spare else "0"], done.stderr
