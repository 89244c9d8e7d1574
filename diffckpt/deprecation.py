"""Renamed public names keep working for one release, with a :class:`DeprecationWarning` that
names the new spelling.

Keyword arguments: :func:`renamed_kwargs`, e.g. the run location, which some functions called
``url`` and others ``dirpath``, is ``dirpath`` everywhere now.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renamed_kwargs", "warn_renamed"]

F = TypeVar("F", bound=Callable[..., Any])


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is spelled ``new`` now (``stacklevel`` 3: the caller of the caller)."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}",
                  DeprecationWarning, stacklevel=stacklevel)


def renamed_kwargs(**renames: str) -> Callable[[F], F]:
    """Accept old keyword names (``renamed_kwargs(url="dirpath")``) as the new ones, warning.

    Positional callers are unaffected. Passing both spellings is a ``TypeError``, as passing one
    argument twice is.
    """
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {old}= and {new}= (the same argument)")
                    warn_renamed(f"{fn.__name__}({old}=...)", f"{fn.__name__}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
