"""The node-local tier in the corners (issue 35): paths that lost kept steps, stopped training or
trusted files another user planted. Each test names the item it covers; each failed on the code
before the fix.

Real processes and files throughout: a training process killed with ``kill -9`` (as in
``test_local_tier.py``), a second user (a forked child that drops to uid 65534, or files handed to
it with ``chown``: CI runs as root), a full folder (a tmpfs of a few pages, mounted as root), an
S3 server (moto). A test that needs root skips without it.
"""

# ruff: noqa: F811  (the fixtures imported from test_local_tier are the tests' parameters)
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import struct
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from engine_runs import OPTIONS, FaultyStorage, Truth, assert_state, make, snapshot, train_steps
from helpers import root_only
from test_local_tier import (  # the fixtures too: one killed training process per module
    DURABLE,
    STEPS,
    Crash,
    crash,  # noqa: F401
    frames,
    journal_files,
    kill,
    killed,  # noqa: F401
    one_thread,  # noqa: F401
    segments,
    start_training,
    truth,  # noqa: F401
)
from test_local_tier import restore as restore_with

from diffckpt import CheckpointEngine, CheckpointOptions, DiffCkptError, FsspecStorage, RetryPolicy
from diffckpt.journal import journal_folder, place_for
from diffckpt.localtier import merge_for_rank, merge_local_tier
from diffckpt.openseg import OpenSegment
from diffckpt.runstore import RunStore

OTHER = 65534  # the second user (nobody)


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary folder every user may write to, like /tmp (sticky, 1777), outside pytest's
    private folders so that the second user reaches it."""
    folder = Path(tempfile.mkdtemp(prefix="diffckpt-shared-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _auto_is_the_temporary_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """These corners are of ``local_dir="auto"`` in the system temporary folder (where it goes
    without ``DIFFCKPT_LOCAL_DIR`` and without room in shared memory), whatever this machine has."""
    monkeypatch.delenv("DIFFCKPT_LOCAL_DIR", raising=False)
    monkeypatch.setattr("diffckpt.journal.default_local_dir", tempfile.gettempdir)


def as_other_user(fn: Callable[[], None], timeout: float = 120.0) -> None:
    """Run ``fn`` in a forked child that dropped to uid/gid 65534 first: a second user of the
    machine, with this process's modules already imported. Its failure is raised here."""
    root_only()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            fn()
        except BaseException:
            os.write(write, traceback.format_exc().encode()[-8000:])
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the second user's process hung")
        time.sleep(0.02)
    with os.fdopen(read, "rb") as f:
        report = f.read().decode()
    assert os.waitstatus_to_exitcode(status) == 0, report


def rewrite_header(journal: Path, **changes: Any) -> None:
    """Replace the journal's header frame by one with ``changes``, checksummed as the writer does
    (b"DJ" | u32 length | JSON | XXH3-128)."""
    data = journal.read_bytes()
    _, end, header = frames(data)[0]
    body = json.dumps({**header, **changes}, separators=(",", ":"), sort_keys=True).encode()
    journal.write_bytes(struct.pack("<2sI", b"DJ", len(body)) + body + xxhash.xxh3_128_digest(body) + data[end:])


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "diffckpt")


def _train(root: Any, local: str | None, steps: int, **options: Any) -> tuple[Truth, int | None]:
    """Train ``steps`` steps from scratch in this process (every step restorable); return the
    truth and what ``close`` made durable."""
    module, optimizers = make()
    engine = CheckpointEngine(root, CheckpointOptions(**{**OPTIONS, "local_dir": local, **options}))
    engine.start(module, optimizers, 0)
    truth = {0: snapshot(module, optimizers, 0)}
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    train_steps(engine, module, optimizers, 1, steps, truth)
    return truth, engine.close()


def _restores(root: Any, truth: Truth, local: str | None) -> int:
    module, optimizers = make()
    result = CheckpointEngine(root, CheckpointOptions(**{**OPTIONS, "local_dir": local})).restore(module, optimizers)
    assert_state(truth, result, module, optimizers)
    return result.step


# ------------------------------------------------------------------------------- steps lost
def test_1_the_merge_of_an_object_store_run_takes_no_room_in_the_temp_folder(
        s3_bucket: Any, tmp_path: Path, truth: Truth, small_disk: Callable[[int], Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 1: the merge copied every record into ``$TMPDIR/diffckpt-spool``; on a small temporary
    folder that failed, the failure was only logged and the steps were lost to the next session.
    Now the records go from the journal's spools straight to the run root."""
    url, local = f"{s3_bucket.url}/run", tmp_path / "local"
    kill(start_training(url, local))  # type: ignore[arg-type]
    tiny = small_disk(8192)  # room for a few kB: not for the journaled records (~1 MB)
    monkeypatch.setattr(tempfile, "tempdir", str(tiny))
    assert restore_with(url, local, truth) == STEPS  # type: ignore[arg-type]
    assert {p.name for p in tiny.iterdir()} <= {"filler", f"diffckpt-{os.geteuid()}"}
    assert not any(p.is_file() for p in tiny.rglob("*") if p.name != "filler")
    assert journal_files(local) == []


def test_1_a_merge_that_cannot_commit_stops_the_resume_and_keeps_the_journal(
        crash: Crash, truth: Truth) -> None:
    """Item 1: a resume that went on after a failed merge would start a session that supersedes
    the journal. It stops with an error that says so, and the journal is kept for the next try."""
    journal = crash.journal.read_bytes()
    broken = FaultyStorage(str(crash.root), fail_at=1, code=errno.ENOSPC)
    engine = CheckpointEngine(broken, CheckpointOptions(**{**OPTIONS, "local_dir": str(crash.local)}))
    module, optimizers = make()
    with pytest.raises(DiffCkptError, match=r"holds steps 6\.\.12 of session g1 .* committing them failed: .*"
                       r"No space left.* fix the cause and resume again"):
        engine.resume(module, optimizers)
    assert crash.journal.read_bytes() == journal and crash.spool.is_file()
    assert restore_with(crash.root, crash.local, truth) == STEPS  # the cause gone: nothing was lost


class HeldStorage(FaultyStorage):
    """:class:`FaultyStorage` whose segment writes wait until ``go`` is set (``held`` says one
    waits): training records more steps while a segment is being committed."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.held, self.go = threading.Event(), threading.Event()

    def write(self, path: str, data: Any) -> None:
        if path.startswith("diffs/") and not self.go.is_set():
            self.held.set()
            self.go.wait(60)
        super().write(path, data)


@pytest.mark.parametrize("cause", ["writer-error", "outage-raise"])
def test_2_a_resume_in_the_same_process_after_a_failed_flush_takes_the_journal(
        tmp_path: Path, cause: str) -> None:
    """Item 2: ``close`` re-raised a failed flush before it closed the open segment's journal, so a
    resume in the same process saw that journal as in use and skipped its steps (5..7 here: the
    open segment while 1..4 were being committed)."""
    root, local = tmp_path / "run", str(tmp_path / "local")
    storage = HeldStorage(str(root))
    module, optimizers = make()
    fast = RetryPolicy(budget_s=0.3, initial_backoff_s=0.01, max_backoff_s=0.05)
    raise_ = {"on_storage_error": "raise"} if cause == "outage-raise" else {}
    engine = CheckpointEngine(storage, CheckpointOptions(**{**OPTIONS, "write_batch": 4, "local_dir": local,
                                                             "base_every_n_steps": 1000, "retry": fast, **raise_}))
    engine.start(module, optimizers, 0)
    truth = {0: snapshot(module, optimizers, 0)}
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    if cause == "writer-error":
        storage.fail_at = storage.writes + 1  # the segment's write fails (a full disk), once let go
    else:
        storage.go.set()
        storage.down.set()  # an outage: the flush raises once it is one
    train_steps(engine, module, optimizers, 1, 7, truth)
    for o in optimizers:  # as the next step begins: the last record's gradients are let go
        o.zero_grad()
    deadline = time.monotonic() + 30
    while engine.recorder.writer.journaled_step != 7:
        assert time.monotonic() < deadline, engine.recorder.writer.journaled_step
        time.sleep(0.01)
    storage.go.set()
    with pytest.raises(DiffCkptError):
        engine.close()
    storage.fail_at = None
    storage.down.clear()
    assert _restores(str(root), truth, local) == 7


def test_2_an_abandon_while_a_segment_waits_its_turn_keeps_it(tmp_path: Path) -> None:
    """Item 2: a writer abandoned while a finished segment waited for its turn (the commit thread
    busy with one, two more waiting) lost that segment: neither queued nor open."""
    root, local = tmp_path / "run", str(tmp_path / "local")
    storage = FaultyStorage(str(root))
    module, optimizers = make()
    fast = RetryPolicy(budget_s=0.3, initial_backoff_s=0.01, max_backoff_s=0.05)
    engine = CheckpointEngine(storage, CheckpointOptions(**{**OPTIONS, "write_batch": 1, "local_dir": local,
                                                             "base_every_n_steps": 1000, "retry": fast}))
    engine.start(module, optimizers, 0)
    truth = {0: snapshot(module, optimizers, 0)}
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    engine.flush()
    storage.down.set()  # segment 0-1 stays in its upload; 1-2 and 2-3 wait; 3-4 waits its turn
    train_steps(engine, module, optimizers, 1, 6, truth)
    deadline = time.monotonic() + 30
    while engine.recorder.writer.journaled_step != 4:
        assert time.monotonic() < deadline, engine.recorder.writer.journaled_step
        time.sleep(0.01)
    time.sleep(0.3)  # the writer thread waits in Committer.start with segment 3-4
    assert engine.close(timeout=0.2) == 0
    storage.down.clear()
    assert _restores(str(root), truth, local) == 4  # 5 and 6 were queued in memory, never journaled


def test_3_a_dead_writer_whose_pid_now_names_a_live_process_is_taken_back(crash: Crash, truth: Truth) -> None:
    """Item 3: liveness by ``kill(pid, 0)``: a reused pid (here the test runner's parent) made a
    dead writer look alive, and its steps were skipped. The writer's lock decides now."""
    rewrite_header(crash.journal, pid=os.getppid())
    assert restore_with(crash.root, crash.local, truth) == STEPS


def test_3_a_live_writer_whose_pid_means_nothing_here_is_left_alone(tmp_path: Path, truth: Truth) -> None:
    """Item 3: a writer in another pid namespace (pods sharing ``local_dir``): its pid names no
    process here, and its journal was taken (and deleted) while it still wrote. Its lock says it
    is alive."""
    root, local = tmp_path / "run", tmp_path / "local"
    proc = start_training(root, local)
    try:
        (journal,) = journal_files(local)
        with open("/proc/sys/kernel/pid_max") as f:
            nowhere = int(f.read()) + 1  # no process here has it: as a pid of another namespace
        rewrite_header(journal, pid=nowhere)
        assert restore_with(root, local, truth) == DURABLE
        assert journal.exists() and segments(root) == [(0, DURABLE, 1)]
    finally:
        kill(proc)
    assert restore_with(root, local, truth) == STEPS  # once it is dead, it is taken back


def test_4_a_later_session_that_made_nothing_durable_does_not_make_the_journal_stale(
        crash: Crash, truth: Truth) -> None:
    """Item 4: a restart elsewhere (no journal there) that died before its first base made every
    older journal stale, and the next resume here deleted the steps it held."""
    module, optimizers = make()
    elsewhere = CheckpointEngine(crash.root, CheckpointOptions(**{**OPTIONS, "local_dir": None}))
    assert elsewhere.restore(module, optimizers).step == DURABLE
    elsewhere.start(module, optimizers, DURABLE)  # session 2, killed before its base
    elsewhere.close()
    assert (crash.root / "sessions" / "g000002.json").exists() or any((crash.root / "sessions").iterdir())
    assert restore_with(crash.root, crash.local, truth) == STEPS


def test_4_after_a_rank_remap_the_rank_on_the_journals_node_takes_the_root_journal(
        crash: Crash, truth: Truth) -> None:
    """Item 4: in unsharded runs only rank 0 merged, so after a restart that put rank 1 on the
    node that journaled, the root journal was skipped. Every rank tries; the journal's lock lets
    one take it, however many try at once."""
    storage = FsspecStorage(str(crash.root))
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            merge_for_rank(storage, str(crash.local), r)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert segments(crash.root) == [(0, DURABLE, 1), (DURABLE, STEPS, 1)]
    assert restore_with(crash.root, None, truth) == STEPS  # the run root alone has them now


# --------------------------------------------------------------------------- training stopped
def test_7_a_second_user_journals_beside_the_first_on_an_object_store(shared_tmp: Path) -> None:
    """Item 7: the first user's spool created the shared journal folder as 0755, and every other
    user's first record failed. Each user now has a folder of their own."""
    url = "memory://issue35-item7"

    def first_record() -> None:
        tempfile.tempdir = str(shared_tmp)
        storage = FsspecStorage(url)
        place = place_for("auto", storage.url)
        segment = OpenSegment(storage, 1, 0, "none", 0, journal=place)
        try:
            assert segment.journal is not None and segment.journaling, "the tier is off"
            assert os.path.dirname(segment.spool.path) == place.folder  # type: ignore[union-attr]
        finally:
            segment.discard()

    saved = tempfile.tempdir
    try:
        first_record()  # this user (root) first
    finally:
        tempfile.tempdir = saved
    as_other_user(first_record)
    mine, theirs = shared_tmp / f"diffckpt-{os.geteuid()}", shared_tmp / f"diffckpt-{OTHER}"
    for folder, uid in ((mine, os.geteuid()), (theirs, OTHER)):
        st = folder.stat()
        assert st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700


def test_8_an_unwritable_local_dir_turns_the_tier_off_and_training_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Item 8: a folder that cannot take the journal stopped training at the first record."""
    (tmp_path / "a-file").write_bytes(b"not a folder")
    root = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        truth, durable = _train(str(root), str(tmp_path / "a-file" / "local"), 9)
    assert durable == 9
    assert "the node-local tier is off for the rest of this session" in _messages(caplog)
    assert "a process crash now loses the steps not yet durable" in _messages(caplog)
    assert _restores(str(root), truth, None) == 9


def test_8_a_local_dir_that_fills_up_turns_the_tier_off_and_training_goes_on(
        tmp_path: Path, small_disk: Callable[[int], Path], caplog: pytest.LogCaptureFixture) -> None:
    """Item 8: a full folder stopped training, and a short write left a torn frame that later
    appends went after. Now the journal ends at its last whole entry and training goes on."""
    disk = small_disk(4096)  # one page: the header and some 20 entries
    root = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        truth, durable = _train(str(root), str(disk), 60, write_batch=100, base_every_n_steps=1000)
    assert durable == 60
    assert "the node-local tier is off" in _messages(caplog) and "No space left" in _messages(caplog)
    assert _restores(str(root), truth, None) == 60


def test_8_an_object_store_with_a_full_temp_folder_spools_in_memory(
        small_disk: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Item 8: on an object store with no room for a spool anywhere, training went no further
    than its first record. The open segment is held in memory (``write_batch`` records)."""
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk(0)))
    url = "memory://issue35-item8"
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        truth, durable = _train(url, "auto", 7)
    assert durable == 7
    assert "kept in memory until it is written" in _messages(caplog)
    assert _restores(url, truth, None) == 7


class DocumentedSpoolStorage:
    """A caller's storage with the documented ``spool(hint)`` (no ``folder``), over local disk;
    the other methods are the local storage's."""

    def __init__(self, root: str) -> None:
        self.inner = FsspecStorage(root)
        self.spools: list[str] = []

    def spool(self, hint: str) -> Any:
        spool = self.inner.spool(hint)
        self.spools.append(spool.path)
        return spool

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_9_a_storage_with_the_documented_spool_method_works_with_the_defaults(tmp_path: Path) -> None:
    """Item 9: ``spool(hint, folder=...)`` was called on a storage that implements the documented
    ``spool(hint)``: a TypeError at the first record with default options."""
    storage = DocumentedSpoolStorage(str(tmp_path / "run"))
    truth, durable = _train(storage, "auto", 8)
    assert durable == 8 and storage.spools  # its spools were used
    assert _restores(str(tmp_path / "run"), truth, None) == 8


# ------------------------------------------------------------------------------------- trust
def _plant(folder: Path, url: str, spool: Path, pid: int = 999_999_999) -> Path:
    """A journal of session 1 of ``url`` naming ``spool``, as another user would leave it."""
    folder.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"journal": 1, "url": url, "gen": 1, "after": DURABLE, "spool": str(spool),
                       "host": os.uname().nodename, "pid": pid}, separators=(",", ":"), sort_keys=True).encode()
    path = folder / "g000001-999999999-deadbeef.journal"
    path.write_bytes(struct.pack("<2sI", b"DJ", len(body)) + body + xxhash.xxh3_128_digest(body))
    return path


def test_11_a_journal_planted_in_the_shared_folder_deletes_nothing(
        tmp_path: Path, shared_tmp: Path, truth: Truth, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 11: another user planted a journal where the victim's resume looked (the shared
    ``diffckpt-journal`` folder), naming a file of the victim's; the resume deleted that file."""
    root_only()
    root = tmp_path / "run"
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    truth, durable = _train(str(root), "auto", 5)
    assert durable == 5
    victim = tmp_path / "precious.txt"
    victim.write_text("the victim's own file")
    url = FsspecStorage(str(root)).url
    key = journal_folder(str(shared_tmp), url).rsplit(os.sep, 1)[1]
    for folder in (shared_tmp / "diffckpt-journal" / key, Path(journal_folder(str(shared_tmp), url))):
        with contextlib.suppress(FileExistsError, PermissionError):
            planted = _plant(folder, url, victim)
            os.chown(planted, OTHER, OTHER)
    os.chown(shared_tmp / "diffckpt-journal", OTHER, OTHER)
    assert _restores(str(root), truth, "auto") == 5
    assert victim.read_text() == "the victim's own file"


def test_11_a_user_folder_squatted_by_another_user_is_refused(
        tmp_path: Path, shared_tmp: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 11: a folder made in the victim's name by another user, holding a planted journal: it
    is never read nor written (the tier is off, with a warning naming it), and nothing goes."""
    root_only()
    root = tmp_path / "run"
    squat = shared_tmp / f"diffckpt-{os.geteuid()}"
    victim = tmp_path / "precious.txt"
    victim.write_text("the victim's own file")
    url = FsspecStorage(str(root)).url
    planted = _plant(Path(journal_folder(str(shared_tmp), url)), url, victim)
    for path in (squat, planted.parent, planted):
        os.chown(path, OTHER, OTHER)
        path.chmod(0o777 if path.is_dir() else 0o666)
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    with caplog.at_level(logging.WARNING, logger="diffckpt"):
        truth, durable = _train(str(root), "auto", 5)
        assert durable == 5
        assert _restores(str(root), truth, "auto") == 5
    assert f"the folder {squat} belongs to user {OTHER}" in _messages(caplog)
    assert victim.read_text() == "the victim's own file" and planted.exists()


def test_11_links_and_fifos_among_the_journals_are_not_followed(crash: Crash, truth: Truth) -> None:
    """Item 11: journal reads followed symlinks and FIFOs (a FIFO blocked the resume forever)."""
    folder = crash.journal.parent
    elsewhere = crash.root.parent / "elsewhere.journal"
    shutil.move(crash.journal, elsewhere)  # the real journal, reached only through a link
    os.symlink(elsewhere, folder / "g000001-1-00000000.journal")
    fifo = folder / "g000001-2-00000000.journal"
    os.mkfifo(fifo)
    restored: list[int] = []
    resume = threading.Thread(target=lambda: restored.append(restore_with(crash.root, crash.local, truth)),
                              daemon=True)
    resume.start()
    resume.join(120)
    try:
        assert not resume.is_alive(), "the resume blocked opening a FIFO"
    finally:
        with contextlib.suppress(OSError):  # a reader blocked on it goes on
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert restored == [DURABLE]  # nothing taken through the link
    assert elsewhere.exists() and segments(crash.root) == [(0, DURABLE, 1)]


def test_11_a_resume_deletes_no_spool_outside_the_places_of_its_own(crash: Crash, truth: Truth) -> None:
    """Item 11: ``JournalFile.remove`` unlinked whatever spool path a header named."""
    victim = crash.root.parent / "precious.tmp"
    victim.write_bytes(b"x" * 64)
    stale = crash.journal.parent / "g000000-1-00000000.journal"
    shutil.copy(crash.journal, stale)
    rewrite_header(stale, gen=0, spool=str(victim))  # a session superseded long ago: stale, removed
    assert restore_with(crash.root, crash.local, truth) == STEPS
    assert not stale.exists() and victim.read_bytes() == b"x" * 64


def test_11_a_journal_of_an_older_run_at_the_same_url_poisons_nothing(crash: Crash) -> None:
    """A run made anew at the same URL (``rm -rf`` and train again) has a session 1 too, and its
    chain can reach the step an old journal continues: that journal's records, whose checksums
    pass, are another run's. The session file's id tells them apart."""
    old, spool = crash.journal, crash.spool
    shutil.rmtree(crash.root)
    module, optimizers = make()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # another run: other weights, the same URL
    engine = CheckpointEngine(crash.root, CheckpointOptions(**{**OPTIONS, "local_dir": str(crash.local)}))
    engine.start(module, optimizers, 0)
    mine = {0: snapshot(module, optimizers, 0)}
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    train_steps(engine, module, optimizers, 1, DURABLE, mine)
    assert engine.close() == DURABLE
    # the old spool back (on an object store it lives beside the journal, not in the run root)
    shutil.copy(crash.pristine / spool.relative_to(crash.root.parent), spool)
    assert _restores(str(crash.root), mine, str(crash.local)) == DURABLE  # nothing of the old run
    assert not old.exists()  # stale: removed


def test_11_merge_local_tier_reads_nothing_from_a_folder_open_to_others(crash: Crash) -> None:
    """A user folder that another user may write to is closed (0700) before anything in it is read."""
    user = crash.journal.parent.parent
    user.chmod(0o777)
    assert merge_local_tier(RunStore(FsspecStorage(str(crash.root))), str(crash.local)) == STEPS
    assert stat.S_IMODE(user.stat().st_mode) == 0o700


# ---------------------------------------------------------------------------------- left behind
def _leftovers(local: Path) -> dict[str, Path]:
    """What dead processes leave in the user's folder, besides journals a resume can use: a spool
    no journal names, a journal killed before its header, and a journal of a run that is gone."""
    user = local / f"diffckpt-{os.geteuid()}"
    other = user / "0123456789abcdef"
    other.mkdir(parents=True, mode=0o700)
    orphan = other / "12345-0badcafe-x.seg.tmp"
    orphan.write_bytes(b"spool bytes")
    headless = other / "g000001-12345-0badcafe.journal"
    headless.write_bytes(b"DJ\x05")
    gone_url = FsspecStorage(str(local.parent / "deleted-run")).url
    gone = _plant(Path(journal_folder(str(local), gone_url)), gone_url, local / "nothing.tmp")
    return {"orphan": orphan, "headless": headless, "gone": gone}


def test_12_gc_local_sweeps_every_run_of_the_host_and_keeps_what_a_resume_can_use(
        crash: Crash, truth: Truth, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 12: journals and spools of crashed runs never resumed on the host stayed forever
    (``sweep`` worked per URL, ``gc`` needed the URL). ``diffckpt gc --local`` needs none."""
    from diffckpt import cli

    journal = crash.journal
    left = _leftovers(crash.local)
    assert cli.main(["gc", "--local", "--local-dir", str(crash.local)]) == 0  # dry run
    out = capsys.readouterr().out
    assert "dry run" in out and "would remove 3 files" in out, out
    assert all(p.exists() for p in left.values()) and journal.exists()
    assert f"kept: a resume on this host takes back steps {DURABLE + 1}..{STEPS}" in out
    assert cli.main(["gc", "--local", "--local-dir", str(crash.local), "--apply", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    gone = {e["path"] for e in report["entries"] if e["status"] in ("dead leftover", "no resume can use it")}
    assert gone == {str(p) for p in left.values()}
    assert not any(p.exists() for p in left.values()) and journal.exists()
    assert restore_with(crash.root, crash.local, truth) == STEPS
    assert cli.main(["gc", "--local-dir", str(crash.local)]) == 2  # neither a URL nor --local


def test_12_a_new_session_sweeps_what_is_provably_dead(tmp_path: Path) -> None:
    """Item 12: a session's first journal sweeps the user's folder of what dead processes left
    (what a resume could still use stays)."""
    local = tmp_path / "local"
    left = _leftovers(local)
    _train(str(tmp_path / "run"), str(local), 3)
    assert not left["orphan"].exists() and not left["headless"].exists()
    assert left["gone"].exists()  # it takes the run root to judge a whole journal: gc --local does
