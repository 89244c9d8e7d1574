"""Where a data loader's epoch order comes from, so that a resume can draw it again.

A ``torch.utils.data.DataLoader`` draws an epoch's order when its iterator is created: the
sampler's permutation and the workers' base seed, from the loader's and the sampler's own
generators when they have one, else from the global torch RNG. Training keeps advancing those
generators, so a mid-epoch resume sets them back to what they were when the interrupted epoch
began, creates the iterator (drawing the same order), drops the consumed batches, and only then
restores the RNG as the record left it. The framework adapters (Accelerate, Fabric) wrap their
loaders differently but share these states.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["epoch_start_state", "loader_generators", "set_epoch_start_state"]


def loader_generators(dataloader: Any) -> list[torch.Generator]:
    """Every generator an epoch's order may draw from besides the global one, in a fixed order."""
    found: list[torch.Generator] = []
    candidates = [getattr(dataloader, "synchronized_generator", None), getattr(dataloader, "generator", None)]
    sampler = getattr(dataloader, "batch_sampler", None)
    for _ in range(4):  # BatchSamplerShard -> BatchSampler -> sampler
        if sampler is None:
            break
        candidates.append(getattr(sampler, "generator", None))
        sampler = getattr(sampler, "batch_sampler", None) or getattr(sampler, "sampler", None)
    for gen in candidates:
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def epoch_start_state(dataloader: Any) -> dict[str, Any]:
    """The global torch RNG and the loader's generators, as the next epoch's order draws them."""
    return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in loader_generators(dataloader)]}


def set_epoch_start_state(dataloader: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`epoch_start_state` captured.

    Raises:
        ValueError: the loader draws from another number of generators than the recorded one.
    """
    torch.set_rng_state(state["torch"])
    gens = loader_generators(dataloader)
    if len(gens) != len(state["generators"]):
        raise ValueError(f"the data loader draws from {len(gens)} generators, the checkpoint recorded "
                         f"{len(state['generators'])}; build it as in the checkpointed run")
    for gen, gen_state in zip(gens, state["generators"]):
        gen.set_state(gen_state)
