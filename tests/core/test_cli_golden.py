"""Golden output of the whole CLI on a small fixed run: what users read must not change by
accident. Timings and the temporary directory are masked; everything else is compared as is.

A deliberate change: ``DIFFCKPT_UPDATE_GOLDEN=1 pytest tests/core/test_cli_golden.py`` rewrites
``tests/golden/cli/*.txt``; review the diff before committing it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from test_cli import cli, fixed_run

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "cli"
_TIMING = re.compile(r"\d+\.\d+ s( \(\d+ steps/s\))?")
_SECONDS = re.compile(r'"(seconds|replay_s|steps_per_s)": [0-9.]+')


def _mask(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp), "<TMP>")
    text = _TIMING.sub(lambda m: "<T> s" + (" (<R> steps/s)" if m[1] else ""), text)
    return _SECONDS.sub(lambda m: f'"{m[1]}": "<T>"', text)


def _check(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("DIFFCKPT_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name}: output changed; see the module docstring to update"


def _fix_compaction_time(root: Path) -> None:
    # The COMMIT of a compacted base records when; its digits would change the listed sizes.
    for commit in root.glob("bases/*/COMMIT"):
        info = json.loads(commit.read_text())
        if "compacted" in info:
            info["compacted"]["time"] = 1700000000.0
            commit.write_text(json.dumps(info, indent=1, sort_keys=True))


def test_cli_golden_session(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    fixed_run(root)  # 13 steps, bases at 0, 5, 10; segments end at 3, 5, 8, 10, 13
    steps = [
        ("gc-dry-run", ["gc", root, "--keep-last-bases", "1"]),
        ("gc-every-json", ["gc", root, "--keep-every-n-steps", "6", "--json"]),
        ("compact", ["compact", root, "--to", "8"]),
        ("compact-again", ["compact", f"{root}/step=8"]),
        ("compact-not-segment-end", ["compact", root, "--to", "7"]),
        ("gc-apply", ["gc", root, "--keep-last-bases", "2", "--apply"]),
        ("ls-after", ["ls", root]),
        ("verify", ["verify", root]),
        ("verify-deep", ["verify", root, "--deep"]),
        ("export", ["export", root, "--step", "9", "-o", tmp_path / "step9.pt"]),
    ]
    for name, argv in steps:
        rc, out, err = cli(capsys, *argv)
        if name == "compact":
            _fix_compaction_time(root)
        _check(name, _mask(f"$ diffckpt {' '.join(map(str, argv))}\nexit {rc}\n{out}"
                           + (f"stderr:\n{err}" if err else ""), tmp_path))


def test_cli_golden_kept_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A step that a framework's save names (a kept marker) in what ``gc`` and ``ls`` show."""
    from diffckpt.keptsteps import KeptSteps
    from diffckpt.storage import open_storage

    root = tmp_path / "run"
    fixed_run(root)
    kept = KeptSteps(open_storage(str(root)), lambda fn: fn(), lambda: 13)
    kept.gen = 1
    kept.keep(3, "saved as best.ckpt")
    for name, argv in [("gc-kept", ["gc", root, "--keep-last-bases", "1"]), ("ls-kept", ["ls", root])]:
        rc, out, err = cli(capsys, *argv)
        _check(name, _mask(f"$ diffckpt {' '.join(map(str, argv))}\nexit {rc}\n{out}"
                           + (f"stderr:\n{err}" if err else ""), tmp_path))


def test_progress_bars_on_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    root = tmp_path / "run"
    fixed_run(root)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, _, err = cli(capsys, "compact", root, "--to", "8")  # replays 3 steps from base 5
    # tqdm bars: "label: 100%|####| done/total [elapsed<ETA, rate]"
    assert rc == 0 and "replaying: 100%" in err and "| 3/3 [" in err
    rc, _, err = cli(capsys, "export", root, "--step", "13", "-o", tmp_path / "x.pt")
    assert rc == 0 and "| 3/3 [" in err  # from base 10
    rc, _, err = cli(capsys, "gc", root, "--keep-last-bases", "1", "--apply")
    assert rc == 0 and "deleting:" in err and "| 10/10 [" in err  # bases 0, 5, 8 and 4 segments
    # Redirected (not a terminal): nothing is drawn.
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    rc, _, err = cli(capsys, "verify", root)
    assert (rc, err) == (0, "")
