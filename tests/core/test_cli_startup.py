"""The command line as a user first meets it: ``--version``, one parser for durations in every
command, human units in ``ls`` (raw numbers in ``--json``), plain wording on a base step, tqdm
progress only on a terminal, and ``--help``, ``ls`` and ``gc`` started without importing torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import Cap, build_run, cli

import diffckpt
from diffckpt.cli import main


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    """A 13-step run with bases at 0, 5 and 10."""
    build_run(tmp_path / "run")
    return tmp_path / "run"


def test_version_flag_prints_the_one_version(capsys: Cap) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"diffckpt {diffckpt.__version__}"
    # The installed distribution reads the same attribute (pyproject: dynamic version).
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("diffckpt")
    except PackageNotFoundError:  # the checkout on PYTHONPATH, not installed (as make gpu-check runs it)
        pytest.skip("diffckpt is not installed")
    assert installed == diffckpt.__version__


@pytest.mark.parametrize("command", ["ls", "verify", "export", "gc", "compact"])
def test_retry_budget_takes_a_duration_in_every_command(run_root: Path, tmp_path: Path, capsys: Cap,
                                                        command: str) -> None:
    root = run_root
    extra = ["-o", tmp_path / "out.ckpt"] if command == "export" else []
    rc, _, err = cli(capsys, command, root, "--retry-budget", "10s", *extra)
    assert rc == 0, err
    rc, _, err = cli(capsys, command, root, "--retry-budget", "ten", *extra)
    assert rc == 2 and "not a duration: 'ten'" in err


def test_ls_prints_sizes_and_durations_in_units_json_keeps_numbers(run_root: Path, capsys: Cap) -> None:
    root = run_root
    rc, out, _ = cli(capsys, "ls", root)
    assert rc == 0
    settings = next(line for line in out.splitlines() if " settings: " in line)
    assert "max_pending_bytes=256MiB" in settings and "retry.budget_s=60s" in settings
    assert "flush_timeout_s=30s" in settings and not re.search(r"=\d{4,}\b", settings)
    rc, out, _ = cli(capsys, "ls", root, "--json")
    assert rc == 0
    options = json.loads(out)["sessions"][0]["options"]
    assert options["max_pending_bytes"] == 256 << 20 and options["retry"]["budget_s"] == 60.0


def test_verify_on_a_base_step_says_it_once(run_root: Path, capsys: Cap) -> None:
    root = run_root
    rc, out, _ = cli(capsys, "verify", f"{root}/step=10")
    assert rc == 0
    assert "step 10 is a base: loaded without replay" in out
    assert "(0 steps)" not in out and "none needed" not in out
    rc, out, _ = cli(capsys, "verify", f"{root}/step=12")
    assert rc == 0 and "replayed step 12 from base 10 (2 steps)" in out and "replay: 2 steps in" in out


def test_progress_is_a_tqdm_bar_with_eta_on_a_terminal(run_root: Path, tmp_path: Path, capsys: Cap,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root = run_root
    out_file = tmp_path / "x.ckpt"
    rc, out, err = cli(capsys, "export", root, "-o", out_file, "--json")
    assert rc == 0 and err == "" and json.loads(out)["step"] == 13  # redirected: no bar at all
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, out, err = cli(capsys, "export", root, "-o", out_file, "--json")
    assert rc == 0 and json.loads(out)["step"] == 13  # stdout stays clean JSON
    assert re.search(r"replaying: +\d+%.*\d+/3 \[[\d:]+<[\d:?]+", err), err  # tqdm: count, elapsed<ETA
    rc, _, err = cli(capsys, "verify", root, "--deep")
    assert rc == 0 and re.search(r"checksums: .*\d+/\d+ \[[\d:]+<", err), err


def test_help_ls_and_gc_do_not_import_torch(run_root: Path) -> None:
    root = run_root
    probe = ("import sys\nfrom diffckpt.cli import main\nrc = main(sys.argv[1:])\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for argv in (["--help"], ["--version"], ["ls", str(root)], ["ls", str(root), "--json"],
                 ["gc", str(root)], ["gc", str(root), "--keep-last-bases", "1", "--min-age", "0", "--apply"]):
        proc = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True,
                              env=env, timeout=120, check=False)
        assert proc.stdout.strip().splitlines()[-1] == "NO-TORCH 0", (argv, proc.stdout, proc.stderr)
    # The lazy package still hands out every public name (and `verify` does load torch).
    proc = subprocess.run([sys.executable, "-c", probe, "verify", str(root)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.stdout.strip().splitlines()[-1] == "TORCH 0"
    for name in diffckpt.__all__:
        assert getattr(diffckpt, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        diffckpt.nope  # noqa: B018
