"""What the Accelerate adapter supports, checked before anything is written.

Each refusal names the problem and what to do instead: a configuration that cannot be replayed
exactly, or one that Accelerate runs silently differently from what it says, never gets a
checkpoint that only looks right.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from diffckpt.errors import UnsupportedConfigurationError

__all__ = ["check_supported", "prepared_model"]

_SHARDED = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP",
            DistributedType.MEGATRON_LM: "Megatron-LM", DistributedType.XLA: "XLA"}


def check_supported(accelerator: Accelerator, url: str) -> None:
    """Raise :class:`UnsupportedConfigurationError` for a setup diffckpt cannot checkpoint exactly."""
    kind = _SHARDED.get(accelerator.distributed_type)
    if kind == "FSDP":
        # FSDP under Accelerate runs only on accelerators (cpu=True turns it into DDP, below), so
        # no test here can run it; an untested path is refused rather than shipped.
        raise UnsupportedConfigurationError(
            "DiffCheckpointer does not support Accelerate's FSDP plugin (fsdp_version 1 or 2) yet: "
            "Accelerate runs FSDP only on GPUs, where this release is not tested. FSDP2 training is "
            "supported in a plain PyTorch loop through diffckpt.CheckpointEngine and in Lightning "
            "through ModelParallelStrategy (see docs/sharded.md); otherwise use accelerator.save_state()")
    if kind is not None:
        raise UnsupportedConfigurationError(
            f"DiffCheckpointer does not support {kind} yet: sharded parameters and optimizer states "
            "cannot be replayed from one rank's diffs. Train with DDP or a single process, or use "
            "accelerator.save_state() for this run")
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and accelerator.distributed_type != DistributedType.FSDP:
        # Accelerator(cpu=True, fsdp_plugin=...) drops the plugin without a word and wraps the
        # model in DDP (accelerate/state.py keeps the plugin only for GPU-like types).
        raise UnsupportedConfigurationError(
            f"an FSDP plugin was given (ACCELERATE_USE_FSDP=true), but Accelerate ignored it and trains "
            f"with {accelerator.distributed_type.value} instead: with cpu=True Accelerate does not shard. "
            "Remove the FSDP plugin (and ACCELERATE_USE_FSDP) to checkpoint this DDP run, or see "
            "docs/sharded.md for sharded training that diffckpt supports")
    parallel = getattr(accelerator, "parallelism_config", None)
    if parallel is not None and any(getattr(parallel, f"{k}_enabled", False) for k in ("tp", "cp", "sp", "dp_shard")):
        raise UnsupportedConfigurationError(
            "DiffCheckpointer does not support tensor, context or sharded data parallelism "
            "(ParallelismConfig) yet; use plain data parallelism (DDP) or accelerator.save_state()")
    if getattr(accelerator, "fp8_enabled", False):
        raise UnsupportedConfigurationError(
            "DiffCheckpointer does not support fp8 training (MS-AMP/Transformer Engine keep scaling "
            "state outside the optimizer); use mixed_precision='bf16' or accelerator.save_state()")
    if getattr(accelerator, "has_lomo_optimizer", False):
        raise UnsupportedConfigurationError(
            "LOMO updates parameters inside backward, not in optimizer.step(), so there is no step "
            "to record; use a torch.optim optimizer or accelerator.save_state()")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and accelerator.num_processes == 1:
        raise UnsupportedConfigurationError(
            f"WORLD_SIZE={world} but the Accelerator runs a single process: on a machine without "
            "GPUs Accelerate only joins the processes when told to use the CPU, so each process "
            "would train alone and write the same run root. Create Accelerator(cpu=True) or set "
            "ACCELERATE_USE_CPU=1 (note: `accelerate launch --cpu` starts one process; use "
            "`accelerate launch --multi_gpu --num_processes N` or torchrun)")
    if accelerator.num_processes > 1 and not accelerator.even_batches:
        raise UnsupportedConfigurationError(
            "DataLoaderConfiguration(even_batches=False) lets processes run different numbers of "
            "batches, but every process records each step together with the others (they gather "
            "their RNG and data positions); keep even_batches=True (the default)")
    if accelerator.num_processes > 1 and url.startswith("memory://"):
        raise UnsupportedConfigurationError(
            "memory:// is private to each process, but every process of a multi-process run "
            "restores by reading the run root; use a local path or object storage shared by all "
            "processes")
    project = accelerator.project_configuration
    if project.automatic_checkpoint_naming and project.project_dir and "://" not in url:
        managed = os.path.realpath(os.path.join(project.project_dir, "checkpoints"))
        if os.path.realpath(url) == managed or os.path.realpath(url).startswith(managed + os.sep):
            raise UnsupportedConfigurationError(
                f"the run root {url} is inside {managed}, which Accelerate rotates by parsing step "
                "numbers out of every name there (total_limit); put the run root elsewhere, e.g. "
                f"{os.path.join(project.project_dir, 'diffckpt')}")


def prepared_model(accelerator: Accelerator, model: Any) -> Any:
    """The model to checkpoint: ``model`` if given, else the only model the accelerator prepared."""
    if model is not None:
        return model
    models = accelerator._models
    if len(models) != 1:
        raise UnsupportedConfigurationError(
            f"the Accelerator prepared {len(models)} models; pass model=<the model accelerator.prepare "
            "returned> to say which one to checkpoint" if models else
            "no model was prepared: call accelerator.prepare(model, optimizer, ...) before "
            "creating the DiffCheckpointer")
    return models[0]
