"""Lightning end to end on S3: real training subprocesses against the moto server over HTTP
(s3fs/aiobotocore/aiohttp), killed with SIGKILL, preempted with SIGTERM during an outage, and
trained through throttling answers and connections cut mid-upload by ``faultproxy``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import train_script
from helpers import ROOT, assert_bitwise_equal, run_script, script_env, step_of, steps_in
from test_exactness import SCRIPT, reference  # noqa: F401  (fixture)

import diffckpt

pytest.importorskip("s3fs")
pytest.importorskip("moto")

# What a user's environment would hold to reach S3; removed to prove storage_options alone work.
# AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE and AWS_EC2_METADATA_DISABLED stay: they keep the
# developer's own AWS setup out.
_AWS_REACH = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
              "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION")


def _steps(log: str) -> list[int]:
    return steps_in(log)


def _resumed_steps(log: str) -> list[int]:
    assert "Restoring states from the checkpoint path" in log, log[-3000:]
    return _steps(log.split("Restoring states from the checkpoint path", 1)[1])


def _layout(target) -> list[str]:
    """Object keys under the run root, relative to it."""
    root = f"{target.bucket}/run/"
    return sorted(p[len(root):] for p in target.fs().find(root))


def _no_aws_env() -> dict[str, str | None]:
    return dict.fromkeys(_AWS_REACH)


class _Training:
    """A training subprocess whose output is read on a thread, so the test can react to STEP
    lines (start an outage, send SIGTERM) and never block on a hung process."""

    def __init__(self, args: list[str], env: dict[str, str | None]) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, SCRIPT), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=script_env(env),
                                     start_new_session=True)
        self.lines: list[str] = []
        self.step = -1
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                if (step := step_of(line)) is not None:
                    self.step = step
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_step(self, n: int, timeout: float = 120) -> int:
        """Wait until the run printed ``STEP m`` with ``m >= n``; return ``m``."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.step >= n or self._eof, timeout)
            assert ok and self.step >= n, f"no STEP {n} (rc {self.proc.poll()}):\n{self.log[-3000:]}"
            return self.step

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        """Wait for the process to exit (killing it if it does not) and for all its output."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"training did not exit within {timeout}s:\n{self.log[-3000:]}") from None
        with self._cond:
            self._cond.wait_for(lambda: self._eof, 30)
        return rc, self.log

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    @property
    def log(self) -> str:
        return "".join(self.lines)


def test_kill9_and_resume_last_with_credentials_from_the_environment(tmp_path, s3_bucket, reference):  # noqa: F811
    """``DiffCheckpoint(dirpath="s3://…")`` configured by the environment alone, as users do."""
    args = ["adamw", str(tmp_path / "killed.pt"), "--dirpath", s3_bucket.url]
    # Drained: the last step printed before the kill landed, which may be past 13 on a loaded machine.
    rc, log = run_script(SCRIPT, args, kill_at_step=13, env=s3_bucket.env, drain=True)
    assert rc == -9, log[-3000:]
    killed_at = _steps(log)[-1]

    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "resumed.pt"), "--dirpath", s3_bucket.url, "--resume"],
                         env=s3_bucket.env)
    assert rc == 0, log[-3000:]
    restored = int(re.search(r"diffckpt: restored step (\d+) from s3://", log).group(1))
    # The kill may land after a step was recorded and before its STEP line (hence + 1); the
    # node-local tier loses at most the step in flight and the one before it. A step recorded
    # after validation prints its STEP line again when resumed.
    assert killed_at - 2 <= restored <= killed_at + 1, (restored, killed_at)
    assert _resumed_steps(log)[0] in (restored, restored + 1), (restored, killed_at)
    assert_bitwise_equal(reference("adamw"), torch.load(tmp_path / "resumed.pt", weights_only=False))

    keys = _layout(s3_bucket)
    assert "run.json" in keys, keys
    # each session's file, and beside it what the session stated each failure loses (informational)
    assert [k for k in keys if k.startswith("sessions/") and not k.endswith(".loss.json")] == [
        "sessions/g000001.json", "sessions/g000002.json"]
    assert "sessions/g000002.loss.json" in keys
    bases = [k for k in keys if re.fullmatch(r"bases/\d{12}\.g\d{6}/COMMIT", k)]
    assert "bases/000000000000.g000001/COMMIT" in bases, keys
    # The resumed session writes no base at the step it continues: its first is the run's next,
    # every 10 steps from the base the restored step rests on (at once if that one is overdue).
    rests_on = int(re.search(rf"diffckpt: restored step {restored} from base (\d+)", log).group(1))
    first = max(restored + 1, rests_on + 10)
    assert next(k for k in bases if k.endswith(".g000002/COMMIT")) == f"bases/{first:012d}.g000002/COMMIT", keys
    segments = [k for k in keys if k.startswith("diffs/")]
    assert segments and all(re.fullmatch(r"diffs/\d{12}-\d{12}\.g00000[12]\.seg", k) for k in segments), keys
    assert any(k.endswith(".g000002.seg") and k.split("-")[1].startswith("000000000030") for k in segments), keys
    assert diffckpt.load_state(s3_bucket.url, storage_options=s3_bucket.storage_options)["step"] == 30


@pytest.mark.slow  # make soak: the kill -9 on S3 above, with credentials from the environment
def test_storage_options_alone_kill9_resume_last_and_explicit_step(tmp_path, s3_bucket, monkeypatch, capsys,
                                                                    reference):  # noqa: F811
    """No AWS variables in the subprocess: endpoint and credentials come from storage_options only,
    for writing, for ``ckpt_path="last"`` and for an explicit ``s3://…/step=N``."""
    # every step durable: step 7 is asked for (paced, a busy machine may skip it)
    options = ["--storage-options", json.dumps(s3_bucket.storage_options), "--options", '{"durability": "every_step"}']
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "killed.pt"), "--dirpath", s3_bucket.url, *options],
                         kill_at_step=17, env=_no_aws_env())
    assert rc == -9, log[-3000:]

    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "last.pt"), "--dirpath", s3_bucket.url, "--resume",
                                  *options], env=_no_aws_env())
    assert rc == 0, log[-3000:]
    assert re.search(r"diffckpt: restored step \d+ from s3://", log), log[-3000:]
    assert_bitwise_equal(reference("adamw"), torch.load(tmp_path / "last.pt", weights_only=False))

    # An explicit step of that run, read from its run root while writing another; in this process
    # (quicker), with the AWS variables that the session fixture exported removed.
    for name in _AWS_REACH:
        monkeypatch.delenv(name, raising=False)
    other = s3_bucket.url + "2"
    train_script.main(["adamw", str(tmp_path / "step7.pt"), "--dirpath", other,
                       "--ckpt-path", f"{s3_bucket.url}/step=7", *options])
    assert _steps(capsys.readouterr().out)[0] in (7, 8)
    assert_bitwise_equal(reference("adamw"), torch.load(tmp_path / "step7.pt", weights_only=False))
    assert diffckpt.load_state(other, storage_options=s3_bucket.storage_options)["step"] == 30


def _wait_for(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_sigterm_during_an_outage_gives_up_the_flush_and_resumes_exactly(tmp_path, s3_bucket, s3_via_proxy,
                                                                          fault_proxy, capsys,
                                                                          reference):  # noqa: F811
    run = _Training(["adamw", str(tmp_path / "x.pt"), "--dirpath", s3_via_proxy.url, "--write-batch", "4",
                     "--base-every", "1000", "--retry-budget", "1", "--flush-timeout", "2",
                     "--step-sleep", "0.1"], env=s3_via_proxy.env)
    try:
        # Some steps are durable (a segment landed), then storage goes away for good.
        _wait_for(lambda: fault_proxy.count("PUT", r"/diffs/", outcome=200) > 0 or run.proc.poll() is not None,
                  "the first segment")
        fault_proxy.outage_until_cleared()
        run.wait_step(run.step + 3)
        run.proc.send_signal(signal.SIGTERM)
        _, log = run.finish(timeout=120)  # exits (its status after SIGTERM is Lightning's business)
    finally:
        run.kill()
        fault_proxy.clear()
    last_step = _steps(log)[-1]
    assert last_step < 30, log[-3000:]  # stopped by the SIGTERM, not by max_steps
    match = re.search(r"stopped by SIGTERM; durable up to step (\d+) in (\S+)", log)
    assert match and match.group(2) == s3_via_proxy.url, log[-3000:]
    durable = int(match.group(1))
    lost = re.search(r"gave up the final flush .*: durable up to step (\d+) in \S+; steps (\d+)\.\.(\d+) were not "
                     r"written", log)
    assert lost, log[-3000:]
    assert int(lost.group(1)) == durable and int(lost.group(2)) == durable + 1, log[-3000:]
    assert durable < int(lost.group(3)) <= last_step, log[-3000:]
    assert 4 <= durable < last_step, log[-3000:]
    assert fault_proxy.count(outcome="reset") > 0

    # The steps the flush gave up stayed in the node-local tier, journaled before SIGTERM.
    kept = re.search(rf"of those, steps {durable + 1}\.\.(\d+) are kept in the local tier on this host", log)
    assert kept and durable < int(kept[1]) <= last_step, log[-3000:]
    # Storage is back: the run root holds exactly step ``durable``; a resume on this node takes the
    # journal's steps back, and training on from there (in this process, for speed) is exact.
    assert diffckpt.load_state(s3_bucket.url, storage_options=s3_bucket.storage_options)["step"] == durable
    capsys.readouterr()
    train_script.main(["adamw", str(tmp_path / "resumed.pt"), "--dirpath", s3_bucket.url, "--resume",
                       "--storage-options", json.dumps(s3_bucket.storage_options)])
    assert _steps(capsys.readouterr().out)[0] in (int(kept[1]), int(kept[1]) + 1)
    assert_bitwise_equal(reference("adamw"), torch.load(tmp_path / "resumed.pt", weights_only=False))


@pytest.mark.slow  # make soak: the SIGTERM flush above during an outage, and on local disk under every front end
def test_sigterm_through_the_proxy_makes_every_step_durable(tmp_path, s3_bucket, s3_via_proxy, fault_proxy):
    run = _Training(["adamw", str(tmp_path / "x.pt"), "--dirpath", s3_via_proxy.url, "--write-batch", "64",
                     "--base-every", "1000", "--flush-timeout", "60"], env=s3_via_proxy.env)
    try:
        sent_at = run.wait_step(7)
        run.proc.send_signal(signal.SIGTERM)
        _, log = run.finish(timeout=120)  # exits (its status after SIGTERM is Lightning's business)
    finally:
        run.kill()
    last_step = _steps(log)[-1]
    match = re.search(r"stopped by SIGTERM; durable up to step (\d+) in ", log)
    assert match and "gave up" not in log, log[-3000:]
    durable = int(match.group(1))
    # write_batch=64 held every step in memory; the flush on SIGTERM wrote them all.
    assert sent_at <= durable <= last_step, log[-3000:]
    assert diffckpt.load_state(s3_bucket.url, storage_options=s3_bucket.storage_options)["step"] == durable
    assert fault_proxy.count("PUT", r"/diffs/", outcome=200) >= 1


def test_training_through_throttling_and_cut_uploads_is_exact(tmp_path, s3_bucket, s3_via_proxy, fault_proxy,
                                                               reference):  # noqa: F811
    fault_proxy.latency(0.005)
    fault_proxy.fail(4, 503, method="PUT")
    # aiohttp resends a reset PUT once by itself: two resets make one upload attempt fail.
    fault_proxy.reset(2, after_body_bytes=2000, method="PUT", path_regex="/diffs/")
    rc, log = run_script(SCRIPT, ["adamw", str(tmp_path / "full.pt"), "--dirpath", s3_via_proxy.url],
                         env=s3_via_proxy.env)
    assert rc == 0, log[-3000:]
    assert_bitwise_equal(reference("adamw"), torch.load(tmp_path / "full.pt", weights_only=False))
    assert fault_proxy.count("PUT", outcome="failed") == 4
    assert fault_proxy.count("PUT", r"/diffs/", outcome="reset") == 2
    assert all(e.body_bytes == 2000 for e in fault_proxy.log if e.outcome == "reset")
    assert re.search(r"diffckpt: write \S+/diffs/\S+ failed .*transient, retry 1", log), log[-3000:]
    assert diffckpt.load_state(s3_bucket.url, storage_options=s3_bucket.storage_options)["step"] == 30

    # Resuming the finished run (in this process, storage_options only) restores step 30 exactly.
    train_script.main(["adamw", str(tmp_path / "again.pt"), "--dirpath", s3_bucket.url, "--resume",
                       "--storage-options", json.dumps(s3_bucket.storage_options)])
    again = torch.load(tmp_path / "again.pt", weights_only=False)
    # Step 30 ends epoch 4 and max_steps: Lightning, resuming there, starts epoch 5 and draws its
    # data order from the torch RNG before it stops, which the uninterrupted run never did
    # (plain Lightning checkpoints behave the same). Everything else must be identical.
    ref = {k: v for k, v in reference("adamw").items() if k not in ("epoch", "rng")}
    assert_bitwise_equal(ref, {k: again[k] for k in ref})
