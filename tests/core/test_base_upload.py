"""A base uploads behind training: with the node-local tier on, the records after a base go on
being journaled while the base's upload runs, and training waits only for the record before it.

The run root is a real :class:`FsspecStorage` behind a wrapper that holds the upload of a base's
``state.safetensors`` (after the starting one) until the test lets it go, as a slow object store
would. While it is held, training records several steps; no segment after the base's step becomes
durable before the base; a ``close(timeout)`` that gives up keeps in the local tier what a resume
on the node needs, and what it restores is bitwise the true state.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from engine_runs import (
    OPTIONS,
    FaultyStorage,
    Truth,
    assert_state,
    make,
    restore,
    seg,
    snapshot,
    train_in_thread,
    train_steps,
)

from diffckpt import CheckpointEngine, CheckpointOptions, DiffCkptError, FsspecStorage
from diffckpt.journal import place_for
from diffckpt.journalfile import journals

BASE = 5  # OPTIONS' base_every_n_steps: the base whose upload is held
AFTER = 9  # training runs to here while it is held (a segment BASE..8 is cut on the way)


class HeldBase(FaultyStorage):
    """Holds the write of each base's ``state.safetensors`` after step 0 until ``go`` is set
    (``held`` says one is waiting); then writes it, or with ``refuse`` fails as a full disk."""

    def __init__(self, root: str, refuse: bool = False) -> None:
        super().__init__(root)
        self.held, self.go, self.refuse = threading.Event(), threading.Event(), refuse

    def write(self, path: str, data: Any) -> None:
        if path.startswith("bases/") and path.endswith("state.safetensors") and not path.startswith("bases/000000000000."):
            self.held.set()
            assert self.go.wait(60), "the test never let the base go"
            if self.refuse:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        super().write(path, data)


def _to_held_base(tmp_path: Path, refuse: bool = False) -> tuple[HeldBase, CheckpointEngine, Truth, Any, Any]:
    """A run at ``tmp_path/run`` (journal in ``tmp_path/local``) trained through the base at
    ``BASE``, whose upload is held once the writer gets to it (the next step lets go of step
    ``BASE``'s gradients)."""
    storage = HeldBase(str(tmp_path / "run"), refuse)
    m, o = make()
    options = CheckpointOptions(**{**OPTIONS, "local_dir": str(tmp_path / "local")})  # type: ignore[arg-type]
    engine = CheckpointEngine(storage, options)  # type: ignore[arg-type]
    engine.start(m, o, 0)
    truth = {0: snapshot(m, o, 0)}
    engine.write_base(0, m.state_dict(), [x.state_dict() for x in o], {"x": 0})
    train_steps(engine, m, o, 1, BASE, truth)
    return storage, engine, truth, m, o


def _train_while_held(storage: HeldBase, engine: CheckpointEngine, truth: Truth, m: Any, o: Any) -> None:
    """Train ``BASE + 1..AFTER`` on another thread; the base's upload must not hold it up."""
    thread, trained, errors = train_in_thread(engine, m, o, BASE + 1, AFTER, truth)
    ok = storage.held.wait(20) and trained.wait(20)
    if not ok:  # let the run end before failing, so that nothing is left blocked
        storage.go.set()
        thread.join(30)
    assert ok, "training waited for the base's upload"
    assert not errors, errors
    assert storage.held.is_set() and not storage.go.is_set()


def _journaled(tmp_path: Path) -> list[int]:
    place = place_for(str(tmp_path / "local"), FsspecStorage(str(tmp_path / "run")).url)
    assert place is not None
    return sorted(e["step"] for j in journals(place.folder, place.url) for e in j.entries)


def _segments_after(storage: HeldBase, step: int) -> list[str]:
    return [p for p in storage.written if p.startswith("diffs/") and int(p[6:18]) >= step]


def test_training_goes_on_while_a_base_uploads_and_the_base_is_durable_first(tmp_path: Path) -> None:
    storage, engine, truth, m, o = _to_held_base(tmp_path)
    _train_while_held(storage, engine, truth, m, o)
    # journaled meanwhile (the last record waits for its gradients' lease, which the next step ends)
    assert set(range(BASE + 1, AFTER)) <= set(_journaled(tmp_path))
    assert not _segments_after(storage, BASE)  # the segment BASE..8 waits behind its base
    assert not seg(tmp_path / "run", BASE, 8).exists()
    storage.go.set()
    assert engine.close() == AFTER
    written = storage.written
    commit = written.index(f"bases/{BASE:012d}.g000001/COMMIT")
    assert all(written.index(p) > commit for p in _segments_after(storage, BASE)), written
    assert _segments_after(storage, BASE) == ["diffs/000000000005-000000000008.g000001.seg",
                                              "diffs/000000000008-000000000009.g000001.seg"]
    for step in range(AFTER + 1):
        result, mod, opts = restore(str(tmp_path / "run"), step)
        assert result.step == step and result.base_step == (BASE if step >= BASE else 0)
        assert_state(truth, result, mod, opts)


def test_close_giving_up_during_a_base_upload_keeps_the_steps_after_it_on_the_node(tmp_path: Path) -> None:
    storage, engine, truth, m, o = _to_held_base(tmp_path)
    _train_while_held(storage, engine, truth, m, o)
    release = threading.Timer(1.0, storage.go.set)  # the held upload ends after close gave up
    release.start()
    try:
        assert engine.close(timeout=0.3) == BASE  # the segment 3..5 went; the base did not
    finally:
        release.join()
    assert not _segments_after(storage, BASE)
    assert not (tmp_path / "run" / "bases" / f"{BASE:012d}.g000001" / "COMMIT").exists()
    assert _journaled(tmp_path) == list(range(BASE + 1, AFTER + 1))
    # A resume on the node takes the journaled steps back: they continue the segment before the
    # base, and replay from the starting base gives them bitwise.
    mod, opts = make()
    result = CheckpointEngine(tmp_path / "run", CheckpointOptions(local_dir=str(tmp_path / "local"))).restore(mod, opts)
    assert (result.step, result.base_step) == (AFTER, 0)
    assert_state(truth, result, mod, opts)


def test_a_base_that_fails_stops_the_segments_after_it_and_training_is_told(tmp_path: Path) -> None:
    storage, engine, truth, m, o = _to_held_base(tmp_path, refuse=True)
    _train_while_held(storage, engine, truth, m, o)
    storage.go.set()
    with pytest.raises(DiffCkptError, match="No space left"):
        engine.flush()
    assert not _segments_after(storage, BASE)  # never durable without their base
    with pytest.raises(DiffCkptError):
        engine.close()
    # What the run root holds restores as it was: the base's step, through the segment before it.
    result, mod, opts = restore(str(tmp_path / "run"), options=CheckpointOptions(local_dir=None))
    assert (result.step, result.base_step) == (BASE, 0)
    assert_state(truth, result, mod, opts)
