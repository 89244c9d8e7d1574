"""``python -m diffckpt``: the command-line tool."""

from .cli import main

raise SystemExit(main())
