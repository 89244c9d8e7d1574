"""What the Trainer adapter supports, checked before anything is written.

Each refusal names the problem and what to do instead: a configuration that cannot be replayed
exactly, or one that the Trainer runs silently differently from what it says, never gets a
checkpoint that only looks right.
"""

from __future__ import annotations

import os
from typing import Any

from diffckpt.errors import UnsupportedConfigurationError

__all__ = ["check_supported"]


def check_supported(trainer: Any, url: str) -> None:
    """Raise :class:`UnsupportedConfigurationError` for a Trainer setup diffckpt cannot replay exactly."""
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False) or args.deepspeed:
        raise UnsupportedConfigurationError(
            "DiffCheckpointCallback does not support DeepSpeed: ZeRO partitions the optimizer state "
            "and steps it inside the engine, where no optimizer step can be recorded or replayed. "
            "Train with DDP or a single process, or use the Trainer's own save_strategy for this run")
    if args.fsdp or getattr(trainer, "is_fsdp_enabled", False) or \
            os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        # On a machine without GPUs the Trainer refuses FSDP with one process and silently trains
        # DDP with several; on GPUs it runs Accelerate's FSDP plugin, which no test here can run.
        raise UnsupportedConfigurationError(
            "DiffCheckpointCallback does not support FSDP through the Trainer (TrainingArguments.fsdp) "
            "yet: the Trainer runs it through Accelerate's FSDP plugin, which needs GPUs and is not "
            "tested with this release (on CPU the Trainer silently trains DDP instead). Remove "
            "fsdp=... to checkpoint DDP training, or see docs/sharded.md for the sharded training "
            "diffckpt supports (plain PyTorch and Lightning)")
    parallel = getattr(args, "parallelism_config", None)
    if parallel is not None and any(getattr(parallel, f"{k}_enabled", False) for k in ("tp", "cp", "sp", "dp_shard")):
        raise UnsupportedConfigurationError(
            "DiffCheckpointCallback does not support tensor, context or sharded data parallelism "
            "(parallelism_config); use plain data parallelism (DDP)")
    if "lomo" in str(args.optim).lower():
        raise UnsupportedConfigurationError(
            f"optim={args.optim!r} updates the parameters inside backward, not in optimizer.step(), "
            "so there is no step to record; use a torch optimizer such as optim='adamw_torch_fused'")
    if args.ignore_data_skip:
        raise UnsupportedConfigurationError(
            "ignore_data_skip=True makes a resumed run restart the interrupted epoch from its first "
            "batch, which no replay can make exact; leave it False (the default) with "
            "DiffCheckpointCallback")
    if args.world_size > 1 and url.startswith("memory://"):
        raise UnsupportedConfigurationError(
            "memory:// is private to each process, but every process of a multi-process run "
            "restores by reading the run root; use a local path or object storage shared by all "
            "processes")
    managed = os.path.realpath(args.output_dir or ".")
    if "://" not in url and (os.path.realpath(url) == managed or
                             os.path.basename(os.path.realpath(url)).startswith("checkpoint-")):
        raise UnsupportedConfigurationError(
            f"the run root {url} is the Trainer's output_dir or looks like one of its checkpoint-N "
            "folders, which the Trainer rotates and resumes from by name; put the run root in a "
            f"folder of its own, e.g. {os.path.join(args.output_dir or '.', 'diffckpt')}")
