"""Objects that act on training's optimizer steps and must stand aside while replay steps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Pausable"]


class Pausable:
    """``with obj.paused(): ...`` makes ``obj`` ignore optimizer steps inside the block."""

    _paused = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused, before = True, self._paused
        try:
            yield
        finally:
            self._paused = before
