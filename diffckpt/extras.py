"""The optional dependencies each adapter package needs, and the error that names the extra to
install when one is missing.

One distribution ships the core and its adapters (``lightning_ckpt``, ``accelerate_ckpt``,
``transformers_ckpt``); the core needs none of the frameworks, and each adapter needs its own,
installed with ``pip install "diffckpt[<extra>]"``. Without this check, importing an adapter
whose framework is missing fails deep inside it, with a message that does not say what to
install (Lightning's: ``'lightning' is not a package``).
"""

from __future__ import annotations

import importlib

__all__ = ["require_extra"]


def require_extra(adapter: str, extra: str, *modules: str) -> None:
    """Import ``modules`` (the frameworks ``adapter`` is written for), or raise ``ImportError``
    naming the one missing and the extra that installs it."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(
                f"{adapter} needs the {name!r} package, which cannot be imported ({exc}). Install "
                f'diffckpt with that extra: pip install "diffckpt[{extra}]"') from exc
