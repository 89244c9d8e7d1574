"""One restore path: ``resume``, ``restore`` and ``load_state`` locate the step from one listing
of the run root, which the plan that follows reuses (a storage wrapper counts the listings)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from engine_runs import assert_state, make, snapshot, train_steps

import diffckpt
from diffckpt import CheckpointEngine, CheckpointOptions, FsspecStorage

ROOT = Path(__file__).resolve().parents[2]


class _Counting:
    """A storage that counts its listings (and existence checks), passing everything through."""

    def __init__(self, root: str) -> None:
        self.inner = FsspecStorage(root)
        self.url = self.inner.url
        self.lists: list[str] = []
        self.exists_calls = 0

    def list(self, prefix: str) -> dict[str, int]:
        self.lists.append(prefix)
        return self.inner.list(prefix)

    def exists(self, path: str) -> bool:
        self.exists_calls += 1
        return self.inner.exists(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _train(root: Path, steps: int) -> dict[int, dict[str, Any]]:
    module, optimizers = make()
    engine = CheckpointEngine(str(root), CheckpointOptions(write_batch=3, base_every_n_steps=5))
    engine.start(module, optimizers, 0)
    truth = {0: snapshot(module, optimizers, 0)}
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    train_steps(engine, module, optimizers, 1, steps, truth)
    engine.close()
    return truth


def test_a_plain_resume_restore_and_load_list_the_run_root_once(tmp_path):
    truth = _train(tmp_path / "run", 12)
    for call in ("resume", "restore", "load_state"):
        storage = _Counting(str(tmp_path / "run"))
        module, optimizers = make()
        if call == "load_state":
            state = diffckpt.load_state(storage)
            assert state["step"] == 12 and all(torch.equal(state["model"][k], v)
                                               for k, v in truth[12]["model"].items())
        else:
            engine = CheckpointEngine(storage)
            result = getattr(engine, call)(module, optimizers)
            assert result is not None
            assert_state(truth, result, module, optimizers)
        assert storage.lists == [""], (call, storage.lists)
        assert storage.exists_calls == 0, call


def test_a_sharded_run_is_located_and_rebuilt_from_one_listing(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(ROOT / "tests/golden/sharded", root)  # a two-rank run, steps 0..4
    storage = _Counting(str(root))
    assert diffckpt.load_state(storage)["step"] == 4
    # The root's listing holds every rank's stream: none is listed again.
    assert storage.lists == [""], storage.lists
