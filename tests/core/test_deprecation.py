"""Renamed keywords keep working for one release with a ``DeprecationWarning`` that names the new
spelling: the run location is ``dirpath`` everywhere (it was ``url`` in some functions)."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
from engine_runs import train

from diffckpt import RetentionPolicy, collect_garbage, compact, export_checkpoint, load_state
from diffckpt.deprecation import renamed_kwargs


def test_renamed_kwargs_maps_the_old_name_and_warns() -> None:
    @renamed_kwargs(url="dirpath")
    def where(dirpath: str, step: int | None = None) -> tuple[str, int | None]:
        return dirpath, step

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling and positional callers: no warning
        assert where("a", 1) == ("a", 1)
        assert where(dirpath="a", step=1) == ("a", 1)
    with pytest.warns(DeprecationWarning, match=r"where\(url=\.\.\.\) is deprecated.*use where\(dirpath=\.\.\.\)") as caught:
        assert where(url="a", step=2) == ("a", 2)
    assert caught[0].filename == __file__  # points at the caller
    with pytest.raises(TypeError, match="both url= and dirpath="):
        where(url="a", dirpath="b")
    assert list(inspect.signature(where).parameters) == ["dirpath", "step"]


@pytest.mark.parametrize("fn", [load_state, export_checkpoint, compact, collect_garbage])
def test_public_functions_take_dirpath(fn: object) -> None:
    assert next(iter(inspect.signature(fn).parameters)) == "dirpath"  # type: ignore[arg-type]


def test_the_old_url_keyword_still_works(tmp_path: Path) -> None:
    root = tmp_path / "run"
    train(root, steps=6)
    with pytest.warns(DeprecationWarning, match=r"load_state\(dirpath=\.\.\.\)"):
        old = load_state(url=root, step=4)
    assert old["step"] == load_state(dirpath=root, step=4)["step"] == load_state(root, 4)["step"] == 4
    with pytest.warns(DeprecationWarning, match=r"collect_garbage\(dirpath=\.\.\.\)"):
        plan = collect_garbage(url=root, policy=RetentionPolicy())
    assert not plan.applied
    with pytest.warns(DeprecationWarning, match=r"export_checkpoint\(dirpath=\.\.\.\)"):
        info = export_checkpoint(url=root, output=tmp_path / "out.pt", step=3)
    assert info["step"] == 3
    with pytest.warns(DeprecationWarning, match=r"compact\(dirpath=\.\.\.\)"):
        result = compact(url=root, to=6)
    assert result.step == 6


def test_after_queued_still_runs_its_call_and_names_when_removed(tmp_path: Path) -> None:
    from diffckpt import CheckpointEngine

    ran: list[int] = []
    with pytest.warns(DeprecationWarning, match=r"when_removed\(fn, name=\.\.\.\)"):
        CheckpointEngine(tmp_path / "run").after_queued(lambda: ran.append(1))
    assert ran == [1]
