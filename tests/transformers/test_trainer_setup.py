"""``DiffCheckpointCallback`` refusals and bad input, with real ``Trainer`` objects in this process:
each gets a clear error naming the problem and the fix, and the run root is left as it was."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
from s3env import need_s3_packages
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from diffckpt import (
    CheckpointOptions,
    CorruptRecordError,
    IncompatibleCheckpointError,
    RetryPolicy,
    StorageUnavailableError,
    UnsupportedConfigurationError,
    load_state,
)
from transformers_ckpt import DiffCheckpointCallback
from transformers_ckpt.support import check_supported

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.arange(16) * (i + 1) % 64
        return {"input_ids": x, "labels": x}


def trainer(tmp_path: Path, root: str, width: int = 32, **args) -> tuple[Trainer, DiffCheckpointCallback]:
    torch.manual_seed(0)
    storage_options = args.pop("so", None)
    evaluate = Rows() if args.get("eval_strategy", "no") != "no" else None
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=width, n_head=2, vocab_size=64, n_positions=16))
    kw = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "per_device_train_batch_size": 4,
          "max_steps": 6, "report_to": "none", "disable_tqdm": True, "save_strategy": "no", **args}
    cb = DiffCheckpointCallback(root, write_batch=1, base_every_n_steps=4, storage_options=storage_options,
                                options=CheckpointOptions(retention=None, retry=RetryPolicy(budget_s=0.3, initial_backoff_s=0.01,
                                                                            max_backoff_s=0.05)))
    return Trainer(model=model, args=TrainingArguments(**kw), train_dataset=Rows(), eval_dataset=evaluate,
                   callbacks=[cb]), cb


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run of 6 steps (bases at 0 and 4, one record per segment); its final weights
    are kept beside it in ``final.pt``."""
    d = tmp_path_factory.mktemp("trained")
    t, cb = trainer(d, str(d / "run"))
    t.train()
    assert cb.durable_step == 6
    torch.save(t.model.state_dict(), d / "final.pt")
    return d / "run"


def test_fresh_run_and_the_start_or_resume_idiom(tmp_path):
    """``resume_from_checkpoint=True`` with nothing durable stops with the Trainer's own error
    before training; ``callback.checkpoint()`` is None on a fresh run, which starts afresh."""
    t, _ = trainer(tmp_path, str(tmp_path / "run"))
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        t.train(resume_from_checkpoint=True)
    t, cb = trainer(tmp_path, str(tmp_path / "run"))
    assert cb.checkpoint() is None
    t.train(resume_from_checkpoint=cb.checkpoint())
    assert cb.resumed_step is None and cb.durable_step == 6


@pytest.mark.parametrize("step", [3, 4])
def test_a_chosen_step_resumes_exactly(trained, tmp_path, step):
    import shutil
    root = tmp_path / "run"
    shutil.copytree(trained, root)
    t, cb = trainer(tmp_path, str(root))
    t.train(resume_from_checkpoint=cb.checkpoint(step))
    assert cb.resumed_step == step and t.state.global_step == 6
    for name, value in torch.load(trained.parent / "final.pt").items():
        assert torch.equal(t.model.state_dict()[name], value), name


def test_another_models_run_is_refused_and_left_as_it_was(trained, tmp_path):
    before = listing(trained)
    t, _ = trainer(tmp_path, str(trained), width=16)
    with pytest.raises(IncompatibleCheckpointError, match="written for a different model"):
        t.train(resume_from_checkpoint=True)
    assert listing(trained) == before


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_damaged_segment_names_the_step_and_the_fix(trained, tmp_path, damage):
    import shutil
    root = tmp_path / "run"
    shutil.copytree(trained, root)
    newest = sorted((root / "diffs").iterdir())[-1]
    data = bytearray(newest.read_bytes())
    if damage == "truncated":
        del data[len(data) // 2:]
    else:
        data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    before = listing(root)
    t, cb = trainer(tmp_path, str(root))
    with pytest.raises(CorruptRecordError, match=r"step 6 of .* cannot be rebuilt .*diffckpt verify.*callback\.checkpoint"):
        t.train(resume_from_checkpoint=True)
    assert listing(root) == before  # nothing was changed, or written over the damage
    # The step before the damaged one resumes as the message says.
    t, cb = trainer(tmp_path, str(root))
    t.train(resume_from_checkpoint=cb.checkpoint(5))
    assert cb.resumed_step == 5 and t.state.global_step == 6


def test_a_missing_segment_resumes_the_newest_step_still_durable(trained, tmp_path):
    """A segment deleted from the run: the steps after it are no longer durable, and
    resume_from_checkpoint=True resumes the newest one that is, exactly."""
    import shutil
    root = tmp_path / "run"
    shutil.copytree(trained, root)
    segments = sorted((root / "diffs").iterdir())
    assert [s.name.split(".")[0] for s in segments][-2:] == ["000000000004-000000000005", "000000000005-000000000006"]
    segments[-2].unlink()  # step 5's record: the chain from base 4 stops there
    t, cb = trainer(tmp_path, str(root))
    t.train(resume_from_checkpoint=True)
    assert cb.resumed_step == 4 and t.state.global_step == 6
    for name, value in torch.load(trained.parent / "final.pt").items():
        assert torch.equal(t.model.state_dict()[name], value), name


def test_an_unreachable_bucket_is_a_clear_error_at_trainer_creation(tmp_path):
    need_s3_packages()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    so = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
          "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    with pytest.raises(StorageUnavailableError, match="storage kept failing"):
        trainer(tmp_path, "s3://no-such-bucket/runs/exp1", so=so)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_ignore_data_skip_is_refused_at_trainer_creation(tmp_path):
    with pytest.raises(UnsupportedConfigurationError, match="ignore_data_skip=True"):
        trainer(tmp_path, str(tmp_path / "run"), ignore_data_skip=True)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, match", [
    ({"optim": "lomo"}, "no step to record"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "does not support DeepSpeed"),
    ({"fsdp": "full_shard"}, "does not support FSDP through the Trainer"),
])
def test_unsupported_trainer_settings_are_refused(setting, match, tmp_path, monkeypatch):
    # DeepSpeed and LOMO are not installed here, and the Trainer refuses FSDP on CPU with one
    # process itself: the check runs on a built Trainer whose arguments say so.
    t, _ = trainer(tmp_path, str(tmp_path / "run"))
    for k, v in setting.items():
        monkeypatch.setattr(t.args, k, v)
    with pytest.raises(UnsupportedConfigurationError, match=match):
        check_supported(t, str(tmp_path / "run"))


def test_memory_storage_with_several_processes_is_refused(tmp_path, monkeypatch):
    t, _ = trainer(tmp_path, "memory://diffckpt-tests/trainer-memory")
    monkeypatch.setattr(type(t.args), "world_size", property(lambda self: 2))
    with pytest.raises(UnsupportedConfigurationError, match="memory:// is private to each process"):
        check_supported(t, "memory://diffckpt-tests/trainer-memory")


def test_callback_states_are_restored_when_the_trainer_is_asked_to(tmp_path):
    """restore_callback_states_from_checkpoint=True: the early-stopping counter of the resumed
    step is back on the live callback (the Trainer itself would find no states in the resume point)."""
    from transformers import EarlyStoppingCallback

    def run(resume: object, counter_at_begin: list[int]) -> tuple[Trainer, DiffCheckpointCallback]:
        early = EarlyStoppingCallback(early_stopping_patience=100, early_stopping_threshold=10.0)

        class Watch(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                counter_at_begin.append(early.early_stopping_patience_counter)

        t, cb = trainer(tmp_path, str(tmp_path / "run"), eval_strategy="steps", eval_steps=1, save_strategy="steps",
                        save_steps=1, save_total_limit=1, load_best_model_at_end=True,
                        restore_callback_states_from_checkpoint=True)
        t.add_callback(early)
        t.add_callback(Watch())
        t.train(resume_from_checkpoint=resume(cb) if callable(resume) else resume)
        return t, cb

    first: list[int] = []
    run(None, first)
    assert first == [0, 0, 1, 2, 3, 4]  # the first eval sets the best; none improves on it by 10.0
    second: list[int] = []
    _, cb = run(lambda cb: cb.checkpoint(3), second)
    assert cb.resumed_step == 3 and second == first[3:]


def test_an_fsdp_plugin_the_trainer_dropped_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what TrainingArguments(fsdp=...) sets
    with pytest.raises(UnsupportedConfigurationError, match="on CPU the Trainer silently trains DDP"):
        trainer(tmp_path, str(tmp_path / "run"))


@pytest.mark.parametrize("where", ["out", "out/checkpoint-7"])
def test_a_run_root_the_trainer_manages_is_refused(where, tmp_path):
    with pytest.raises(UnsupportedConfigurationError, match="folder of its own"):
        trainer(tmp_path, str(tmp_path / where))


def test_load_best_model_at_end_records_the_last_step_not_the_best_weights(tmp_path):
    """The Trainer loads the best checkpoint's weights before on_train_end: the last step is
    recorded before that, and the run ends on the trained weights, as a run without it does."""
    best = {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2,
            "load_best_model_at_end": True, "metric_for_best_model": "loss", "greater_is_better": True}
    t, cb = trainer(tmp_path / "best", str(tmp_path / "run"), **best)
    t.train()
    assert t.state.best_model_checkpoint is not None and not t.state.best_model_checkpoint.endswith("-6")
    ref, _ = trainer(tmp_path / "ref", str(tmp_path / "ref_run"), **dict(best, load_best_model_at_end=False))
    ref.train()
    loaded = load_state(str(tmp_path / "run"))
    assert cb.durable_step == loaded["step"] == 6
    for name, value in ref.model.state_dict().items():
        assert torch.equal(loaded["model"][name], value), name
