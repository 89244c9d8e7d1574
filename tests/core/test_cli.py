"""The ``diffckpt`` command line: ``ls``, ``verify`` and ``export`` on a real run on disk.

Runs are recorded with the core engine directly (no Lightning), then inspected in-process through
``main([...])``; one test goes through the installed console script to prove the entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from engine_runs import record_span

from diffckpt import CheckpointEngine, CheckpointOptions
from diffckpt.cli import main
from diffckpt.rng import get_rng_state

STEPS = 13
Run = tuple[Path, dict[int, dict[str, Any]]]
Cap = pytest.CaptureFixture[str]
CB_KEY = "DiffCheckpoint{'dirpath': 'run'}"


def _copy(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else _copy(v) if isinstance(v, dict) else v
            for k, v in sd.items()}


def build_run(root: Path, state_fn: Callable[[int], Any] = lambda step: {"x": step},
              model: torch.nn.Module | None = None, **options: Any) -> dict[int, dict[str, Any]]:
    """Record 13 AdamW steps; return the model and optimizer state at every step."""
    torch.manual_seed(0)
    m = model or torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                     torch.nn.Linear(16, 1))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    # retention=None: every recorded step stays, for the commands to list, verify and export.
    opts = CheckpointOptions(**{"write_batch": 3, "base_every_n_steps": 5, "fingerprint_every_n_steps": 2,
                                "retention": None, **options})
    eng = CheckpointEngine(str(root), opts)
    eng.start(m, [o], 0)
    eng.write_base(0, m.state_dict(), [o.state_dict()], state_fn(0))
    states = {0: {"model": _copy(m.state_dict())}}
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 8)
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
        eng.record_step(step, state_fn(step))
        if eng.wants_base(step):
            eng.write_base(step, m.state_dict(), [o.state_dict()], state_fn(step))
        states[step] = {"model": _copy(m.state_dict()), "optimizer": _copy(o.state_dict())}
    eng.close()
    return states


def _with_rng(step: int) -> dict[str, Any]:
    # What DiffCheckpoint records: its callback state holds the numpy RNG state (numpy arrays).
    return {"x": step, "callbacks": {CB_KEY: {"rng": get_rng_state(), "dirpath": "run"}}}


@pytest.fixture
def run(tmp_path: Path) -> Run:
    root = tmp_path / "run"
    return root, build_run(root, _with_rng)


def cli(capsys: Cap, *argv: Any) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------- ls
GOLDEN_LS = """\
run <TMP>/run
newest durable step 13 (g1): ckpt_path="<TMP>/run" (or "last" with DiffCheckpoint)

sessions
  gen  started                  resumed_from  durable  newest  ckpt_path
  g1   2023-11-14 22:13:20 UTC  0             0..13    13      <TMP>/run/step=13
  g1 settings: base_every_n_steps=5 compression=none compression_level=1 copy_gradients=False durability=paced every_n_steps=1 fingerprint_every_n_steps=2 flush_timeout_s=30s local_dir=auto max_pending_bytes=256MiB on_storage_error=block retry.budget_s=60s retry.initial_backoff_s=200ms retry.max_backoff_s=10s write_batch=3
  g1 loss per failure (measured at its first step): a process crash loses at most 1 step; a node loss loses at most 4 steps (~40 ms)

bases
  step  gen  size     path
  0     g1   2.4 KiB  bases/000000000000.g000001
  5     g1   5.8 KiB  bases/000000000005.g000001
  10    g1   5.8 KiB  bases/000000000010.g000001

segments
  after..last  gen  steps  size     path
  0..3         g1   3      7.5 KiB  diffs/000000000000-000000000003.g000001.seg
  3..5         g1   2      5.0 KiB  diffs/000000000003-000000000005.g000001.seg
  5..8         g1   3      7.6 KiB  diffs/000000000005-000000000008.g000001.seg
  8..10        g1   2      5.1 KiB  diffs/000000000008-000000000010.g000001.seg
  10..13       g1   3      7.7 KiB  diffs/000000000010-000000000013.g000001.seg

totals
  on storage  48.4 KiB (49512 B)
  bases       13.9 KiB (14241 B)
  diffs       32.9 KiB (33717 B) over 13 steps, 2.5 KiB per step
  other       1.5 KiB (1554 B)

resume any durable step N with ckpt_path="<TMP>/run/step=N"
"""


def fixed_run(root: Path) -> dict[int, dict[str, Any]]:
    """:func:`build_run` with output that is the same on every machine and every day."""
    # Uncompressed, so sizes depend on tensor shapes only, not on the float bits a CPU produces.
    states = build_run(root, compression="none")
    # Fixed timestamps, host and pid: the listing shows times, and their digits change the JSON sizes.
    for name, key in (("sessions/g000001.json", "started"), ("run.json", "updated")):
        body = json.loads((root / name).read_text())
        body[key] = 1700000000.0
        body.update({"host": "host", "pid": 1} if "host" in body else {})
        indent = 1 if name.startswith("sessions") else None
        (root / name).write_text(json.dumps(body, indent=indent, sort_keys=True))
    # What each failure loses is measured: its statement is fixed too (ls shows it as it is).
    loss = json.loads((root / "sessions/g000001.loss.json").read_text())
    assert set(loss) == {"crash_steps", "node_steps", "node_seconds", "keeps_up", "floor_s", "text"}
    loss.update(crash_steps=1, node_steps=4, node_seconds=0.04, keeps_up=True, floor_s=0.0,
                text="a process crash loses at most 1 step; a node loss loses at most 4 steps (~40 ms)")
    (root / "sessions/g000001.loss.json").write_text(json.dumps(loss))
    return states


def test_ls_golden(tmp_path: Path, capsys: Cap) -> None:
    root = tmp_path / "run"
    fixed_run(root)
    rc, out, err = cli(capsys, "ls", root)
    assert (rc, err) == (0, "")
    assert out.replace(str(tmp_path), "<TMP>") == GOLDEN_LS


def test_ls_json(run: Run, capsys: Cap) -> None:
    root, _ = run
    rc, out, _ = cli(capsys, "ls", root, "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["newest"] == {"gen": 1, "step": STEPS, "ckpt_path": str(root)}
    assert [b["step"] for b in d["bases"]] == [0, 5, 10]
    spans = [(s["after"], s["last"]) for s in d["segments"]]
    assert spans == [(0, 3), (3, 5), (5, 8), (8, 10), (10, 13)]
    (session,) = d["sessions"]
    assert session["durable"] == [[0, STEPS]] and session["newest_step"] == STEPS
    assert session["ckpt_path"] == f"{root}/step={STEPS}"
    assert session["options"]["write_batch"] == 3 and session["resumed_from"] == 0
    on_disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    t = d["totals"]
    assert t["bytes"] == on_disk and t["diff_steps"] == STEPS
    assert t["bytes"] == t["base_bytes"] + t["diff_bytes"] + t["other_bytes"]
    assert t["avg_diff_bytes_per_step"] == round(t["diff_bytes"] / STEPS)


def test_ls_missing_run_exits_2(tmp_path: Path, capsys: Cap) -> None:
    (tmp_path / "empty").mkdir()
    for where in (tmp_path / "empty", tmp_path / "absent"):
        rc, out, err = cli(capsys, "ls", where)
        assert rc == 2 and out == ""
        assert err.startswith("error: no diffckpt run under ")


def test_usage_errors_exit_2(run: Run, capsys: Cap) -> None:
    root, _ = run
    assert cli(capsys)[0] == 2
    assert cli(capsys, "export", root)[0] == 2  # -o is required
    assert cli(capsys, "export", root, "-o", "x.pt", "--format", "zip")[0] == 2
    assert cli(capsys, "verify", root, "--step", "99")[0] == 2


# --------------------------------------------------------------------------------- verify
def test_verify_good_run(run: Run, capsys: Cap) -> None:
    root, _ = run
    rc, out, err = cli(capsys, "verify", root)
    assert rc == 0, out + err
    assert "replayed step 13 from base 10 (3 steps)" in out
    assert out.rstrip().endswith("OK: every checksum matches")
    rc, out, _ = cli(capsys, "verify", root, "--step", "7", "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] and report["problems"] == []
    replay_s = report["replay"].pop("replay_s")
    assert report["replay"] == {"target": 7, "base_step": 5, "step": 7, "replayed": 2} and replay_s > 0
    assert (report["bases"], report["segments"], report["records"]) == (3, 5, STEPS)


def test_verify_flipped_byte_in_segment(run: Run, capsys: Cap) -> None:
    root, _ = run
    name = "diffs/000000000003-000000000005.g000001.seg"
    data = bytearray((root / name).read_bytes())
    offset, length = record_span(bytes(data), 4)  # the segment's first record
    data[offset + length // 2] ^= 0x01  # inside the record of step 4
    (root / name).write_bytes(bytes(data))
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 1
    assert f"BAD {name}: " in out and "checksum" in out
    assert "FAILED" in out
    # A step whose replay reads the damaged segment fails too, and says so.
    rc, out, _ = cli(capsys, "verify", root, "--step", "4", "--json")
    report = json.loads(out)
    assert rc == 1 and not report["ok"]
    assert [p["object"] for p in report["problems"]] == [name, "replay"]


def test_verify_truncated_base(run: Run, capsys: Cap) -> None:
    root, _ = run
    name = "bases/000000000010.g000001/state.safetensors"
    data = (root / name).read_bytes()
    (root / name).write_bytes(data[: len(data) // 2])
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 1
    assert f"BAD {name}: fails its checksum" in out
    # the newest step is rebuilt from the older base 5 instead, and verify reports that it had to
    assert "BAD replay: diffckpt: " in out and "using the older base at step 5 instead, restoring step 13" in out


def test_verify_notes_uncommitted_base(run: Run, capsys: Cap) -> None:
    root, _ = run
    (root / "bases/000000000015.g000001").mkdir()
    (root / "bases/000000000015.g000001/state.safetensors").write_bytes(b"partial")
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 0
    assert "note: bases/000000000015.g000001 has no COMMIT" in out


# --------------------------------------------------------------------------------- export
def test_export_lightning_ckpt(run: Run, tmp_path: Path, capsys: Cap) -> None:
    root, states = run
    out_file = tmp_path / "out" / "step7.ckpt"
    rc, out, err = cli(capsys, "export", root, "--step", "7", "-o", out_file)
    assert rc == 0, err
    size = out_file.stat().st_size
    assert out.startswith(f"wrote {out_file}: step 7 (lightning, ") and f"{size} B" in out
    ckpt = torch.load(out_file, weights_only=True)  # what load_from_checkpoint does
    assert ckpt["x"] == 7 and ckpt["global_step"] == 7 and "pytorch-lightning_version" in ckpt
    assert set(ckpt["state_dict"]) == set(states[7]["model"])
    for k, v in states[7]["model"].items():
        assert torch.equal(ckpt["state_dict"][k], v), k
    (opt,) = ckpt["optimizer_states"]
    want = states[7]["optimizer"]
    assert opt["param_groups"] == want["param_groups"]
    for i, slots in want["state"].items():
        for k, v in slots.items():
            assert torch.equal(opt["state"][i][k], v), (i, k)
    rng = ckpt["callbacks"][CB_KEY]["rng"]
    assert rng["numpy"][0] == "MT19937" and rng["numpy"][1].dtype == torch.uint32


def test_export_safetensors_newest(run: Run, tmp_path: Path,
                                   capsys: Cap) -> None:
    root, states = run
    out_file = tmp_path / "model.safetensors"
    rc, out, _ = cli(capsys, "export", root, "-o", out_file)
    assert rc == 0 and "step 13 (safetensors, " in out
    tensors = safetensors.torch.load_file(str(out_file))
    assert set(tensors) == set(states[STEPS]["model"])
    for k, v in states[STEPS]["model"].items():
        assert torch.equal(tensors[k], v), k


def test_export_torch_from_step_url(run: Run, tmp_path: Path,
                                    capsys: Cap) -> None:
    root, states = run
    out_file = tmp_path / "state.pt"
    rc, out, _ = cli(capsys, "export", f"{root}/step=4", "-o", out_file)  # the form `ls` prints
    assert rc == 0 and "step 4 (torch, " in out
    obj = torch.load(out_file, weights_only=True)
    assert set(obj) == {"model", "optimizer", "step"} and obj["step"] == 4
    for k, v in states[4]["model"].items():
        assert torch.equal(obj["model"][k], v), k
    want = states[4]["optimizer"]  # one optimizer: its state dict as is, for load_state_dict
    assert obj["optimizer"]["param_groups"] == want["param_groups"]
    for i, slots in want["state"].items():
        for k, v in slots.items():
            assert torch.equal(obj["optimizer"]["state"][i][k], v), (i, k)


def test_export_json(run: Run, tmp_path: Path, capsys: Cap) -> None:
    root, _ = run
    out_file = tmp_path / "step9.ckpt"
    rc, out, _ = cli(capsys, "export", root, "--step", "9", "-o", out_file, "--json")
    assert rc == 0
    report = json.loads(out)
    assert report.pop("replay_s") > 0
    assert report == {"step": 9, "format": "lightning", "bytes": out_file.stat().st_size,
                      "base_step": 5, "replayed": 4, "path": str(out_file)}


def test_export_non_durable_step_exits_2(run: Run, tmp_path: Path,
                                         capsys: Cap) -> None:
    root, _ = run
    out_file = tmp_path / "x.ckpt"
    rc, out, err = cli(capsys, "export", root, "--step", "99", "-o", out_file)
    assert (rc, out) == (2, "")
    assert err.startswith("error: step 99 is not durable") and "0..13" in err
    assert not out_file.exists()


def test_export_loads_with_lightning(tmp_path: Path, capsys: Cap) -> None:
    L = pytest.importorskip("lightning")

    class Net(L.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                           torch.nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    states = build_run(tmp_path / "run", _with_rng, model=Net())
    out_file = tmp_path / "net.ckpt"
    assert cli(capsys, "export", tmp_path / "run", "--step", "10", "-o", out_file)[0] == 0
    loaded = Net.load_from_checkpoint(out_file)
    for k, v in states[10]["model"].items():
        assert torch.equal(loaded.state_dict()[k], v), k


# ------------------------------------------------------------------------- entry points
def test_console_script_and_module(run: Run) -> None:
    root, _ = run
    script = Path(sys.executable).with_name("diffckpt")
    if not script.exists():
        pytest.skip("console script not installed (pip install -e .)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(script), "ls", str(root)], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f'newest durable step 13 (g1): ckpt_path="{root}"' in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "diffckpt", "ls", str(root / "nope")],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no diffckpt run")


def test_ls_and_export_after_resume(run: Run, tmp_path: Path, capsys: Cap) -> None:
    root, _ = run
    # A second session resumes from step 8 and records 3 steps: g1 keeps its steps up to 13, but
    # ckpt_path=<root> resumes the newest session, as planning.plan decides.
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                            torch.nn.Linear(16, 1))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    eng = CheckpointEngine(str(root), CheckpointOptions(write_batch=2, base_every_n_steps=None))
    eng.restore(m, [o], 8)
    eng.start(m, [o], 8)
    eng.write_base(8, m.state_dict(), [o.state_dict()], _with_rng(8))
    for step in (9, 10, 11):
        o.zero_grad()
        m(torch.randn(4, 8)).pow(2).mean().backward()
        o.step()
        eng.record_step(step, _with_rng(step))
    eng.close()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    rc, out, _ = cli(capsys, "ls", root, "--json")
    d = json.loads(out)
    assert rc == 0 and d["newest"] == {"gen": 2, "step": 11, "ckpt_path": str(root)}
    by_gen = {s["gen"]: s for s in d["sessions"]}
    assert by_gen[1]["newest_step"] == 13 and by_gen[2]["durable"] == [[8, 11]]
    assert by_gen[2]["resumed_from"] == 8 and by_gen[2]["options"]["write_batch"] == 2
    spans = [(s["after"], s["last"], s["gen"]) for s in d["segments"]]
    assert spans[-3:] == [(10, 13, 1), (8, 10, 2), (10, 11, 2)]  # grouped by session
    rc, out, _ = cli(capsys, "ls", root)
    assert "  g2   " in out and f"{root}/step=11" in out
    out_file = tmp_path / "newest.pt"
    assert cli(capsys, "export", root, "-o", out_file)[0] == 0
    obj = torch.load(out_file, weights_only=True)
    assert obj["step"] == 11
    for k, v in want.items():
        assert torch.equal(obj["model"][k], v), k
    assert cli(capsys, "verify", root)[0] == 0


def test_progress_only_on_a_terminal(run: Run, capsys: Cap,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = run
    assert cli(capsys, "verify", root)[2] == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, out, err = cli(capsys, "verify", root)
    assert rc == 0 and "\r" in err and "diffs/" in err and "\r" not in out
