"""What happens to a run after it is written: retention (garbage collection), compaction (bases
rolled forward from stored diffs) and the background thread that runs both beside training."""

__all__: list[str] = []  # the modules are imported by name: diffckpt.lifecycle.retention, ...
