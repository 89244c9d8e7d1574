"""The checkpointing metrics in the training logs the Trainer's reporting integrations receive."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from diffckpt.integration import StepDriver

__all__ = ["MetricsToReports"]


class MetricsToReports(TrainerCallback):
    """Adds the core's ``diffckpt/*`` metrics to each training log (every ``logging_steps``) as
    the callbacks after it, the reporting integrations included, receive it.

    ``Trainer.log`` appends a copy of the logs to ``state.log_history`` before any callback runs,
    so the metrics never enter ``log_history`` nor ``trainer_state.json``: those stay what a run
    without diffckpt writes (the metrics depend on the writer's timing, not on training)."""

    def __init__(self, driver: StepDriver) -> None:
        self.driver = driver  # the callback's session: metrics only while it records

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        driver = self.driver
        if logs is not None and "loss" in logs and driver.started and not driver.closed:  # not evaluation
            logs.update(driver.engine.metrics())  # empty where this process does not write
