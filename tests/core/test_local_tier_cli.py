"""What the command line says of the node-local tier: ``diffckpt ls`` names the steps only this
host's journals hold (what the loss of the host would lose), ``diffckpt gc`` removes journals no
resume can use and never one that a resume can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import cli
from test_streaming import killed_during_an_open_segment, wide

from diffckpt import CheckpointEngine, CheckpointOptions
from diffckpt.journal import place_for
from diffckpt.journalfile import journals
from diffckpt.localtier import read_local_tier
from diffckpt.runstore import RunStore
from diffckpt.storage import FsspecStorage

Cap = pytest.CaptureFixture[str]


def _journals(root: Path, local: str) -> list[str]:
    place = place_for(local, FsspecStorage(str(root)).url)
    assert place is not None
    return [j.path for j in journals(place.folder, place.url)]


def test_ls_names_the_steps_only_the_local_tier_holds_and_gc_keeps_that_journal(tmp_path: Path,
                                                                                 capsys: Cap) -> None:
    root, local = tmp_path / "run", str(tmp_path / "local")
    killed_during_an_open_segment(root, local)
    held = _journals(root, local)
    tier = read_local_tier(RunStore(FsspecStorage(str(root))), local)
    assert held and tier.step is not None and tier.step >= 4  # step 5 too, if its lease ended in time
    n = tier.step
    rc, out, _ = cli(capsys, "ls", root, "--local-dir", local)
    assert rc == 0
    assert "newest durable step 0 (g1)" in out  # the run root alone
    line = next(x for x in out.splitlines() if x.startswith("local tier on this host"))
    assert f"steps 1..{n} of g1" in line and "a resume on this host takes them back" in line, out
    rc, out, _ = cli(capsys, "ls", root, "--local-dir", local, "--json")
    assert [(t["after"], t["step"], t["gen"]) for t in json.loads(out)["local_tier"]] == [(0, n, 1)]
    assert "local tier" not in cli(capsys, "ls", root, "--local-dir", "none")[1]
    # gc leaves a journal a resume can use, and its spools on the run root however old
    spools = sorted((root / "diffs").glob(".*.tmp"))
    assert spools
    rc, out, _ = cli(capsys, "gc", root, "--local-dir", local, "--keep-last-bases", "2", "--min-age", "0s", "--apply")
    assert rc == 0 and "journal" not in out and _journals(root, local) == held
    assert sorted((root / "diffs").glob(".*.tmp")) == spools

    # Once a resume took the records into the run root, nothing is left for either command.
    module, optimizers = wide()
    assert CheckpointEngine(root, CheckpointOptions(local_dir=local)).restore(module, optimizers).step == n
    assert _journals(root, local) == []
    assert "local tier" not in cli(capsys, "ls", root, "--local-dir", local)[1]


def test_gc_removes_the_journal_of_a_superseded_session(tmp_path: Path, capsys: Cap) -> None:
    root, local = tmp_path / "run", str(tmp_path / "local")
    killed_during_an_open_segment(root, local)
    held = _journals(root, local)
    # A job elsewhere (no journal) resumed from the run root and started session g2: the journal
    # of g1 is stale, and a resume here must not take it.
    module, optimizers = wide()
    engine = CheckpointEngine(root, CheckpointOptions(local_dir=None))
    assert engine.restore(module, optimizers).step == 0
    engine.start(module, optimizers, 0)
    engine.write_base(0, module.state_dict(), [o.state_dict() for o in optimizers], {"x": 0})
    engine.close()
    rc, out, _ = cli(capsys, "ls", root, "--local-dir", local)
    assert "local tier on this host" not in out
    rc, out, _ = cli(capsys, "gc", root, "--local-dir", local)  # dry run: names it, keeps it
    assert "would delete 1 journal" in out and held[0] in out and _journals(root, local) == held
    rc, out, _ = cli(capsys, "gc", root, "--local-dir", local, "--apply")
    assert rc == 0 and "deleted 1 journal" in out and _journals(root, local) == []
