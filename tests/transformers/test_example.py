"""examples/transformers_train.py: a Trainer run without diffckpt, the same run with
``DiffCheckpointCallback`` killed with SIGKILL midway, a resume with
``trainer.train(resume_from_checkpoint=True)``, and every tensor compared with ``torch.equal``."""

from __future__ import annotations

import re

import pytest
from helpers import run_script


# make soak: test_trainer_training.py's kill -9 tests resume the Trainer with the same callback, bitwise.
@pytest.mark.slow
def test_example_is_bit_exact():
    rc, log = run_script("examples/transformers_train.py", ["--epochs", "2", "--seed", "3"])
    assert rc == 0 and "bit-exact: yes" in log, log[-3000:]
    assert re.search(r"log history\s+equal", log), log[-3000:]
    killed = int(re.search(r"killed with SIGKILL after step\s+(\d+)", log).group(1))
    resumed = int(re.search(r"resumed from step \(newest durable\)\s+(\d+)", log).group(1))
    assert 0 < resumed <= killed < 32, log[-3000:]  # 2 epochs of 16 steps: the kill landed mid-run
