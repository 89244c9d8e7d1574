"""The ``diffckpt`` command: inspect, verify, export, prune and compact runs; plan settings.

- ``diffckpt ls URL``: sessions, bases and segments (:mod:`.ls`).
- ``diffckpt verify URL [--deep]``: every checksum and a replay (:mod:`.verify`).
- ``diffckpt export URL --step N -o FILE``: a plain checkpoint (:mod:`.export`).
- ``diffckpt gc URL`` and ``diffckpt compact URL``: bounded storage and short restores
  (:mod:`.gc`, :mod:`.compact`).
- ``diffckpt tune URL --params N --step-time T``: probe storage, recommend settings (:mod:`.tune`).

On a sharded run root (FSDP2) ``ls``, ``verify``, ``export``, ``gc`` and ``compact`` cover every
rank's stream under ``ranks/r<rank>/`` and the steps durable on every rank (:mod:`.sharded`).

This module holds the entry point (:func:`main`), the top-level parser and the mapping of errors
to exit codes: 0 success, 1 damage or a failed operation, 2 usage errors and runs or steps that do
not exist. What the commands share is in :mod:`.common`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import CheckpointNotFoundError, DiffCkptError, UnsupportedConfigurationError
from ..units import parse_duration

__all__ = ["main"]

# Each command's module is imported only when that command runs (or its --help is asked for):
# ``diffckpt --help``, ``ls`` and ``gc`` then start without importing torch. Name: (help, the
# shared argument groups it takes).
_COMMANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ls": ("list sessions, bases and segments", ("common", "json")),
    "verify": ("check every checksum and replay a step with its fingerprints", ("common", "replaying", "json")),
    "export": ("write a step as a checkpoint", ("common", "replaying", "json")),
    "gc": ("delete what a retention policy no longer keeps (dry run unless --apply)", ("storage", "json")),
    "compact": ("roll a base forward from stored diffs (no training process needed)", ("common", "json")),
    # tune probes a location that need not hold a run yet: its own URL, storage and retry options.
    "tune": ("probe storage and recommend every_n_steps, write_batch, base_every_n_steps", ()),
}
_REPLAYING = ("verify", "export", "compact")  # the commands that replay steps: a progress bar for it


def _groups() -> dict[str, argparse.ArgumentParser]:
    storage = argparse.ArgumentParser(add_help=False)  # gc takes its URL itself: gc --local needs none
    storage.add_argument("-O", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                         help="fsspec storage option (repeatable; VALUE may be JSON)")
    storage.add_argument("--retry-budget", type=parse_duration, default=60.0, metavar="DURATION",
                         help="how long transient storage failures are retried (e.g. 10s, 2m; default 60s)")
    common = argparse.ArgumentParser(add_help=False, parents=[storage])
    common.add_argument("url", metavar="URL",
                        help="run root (local path or fsspec URL); <URL>/step=N names a step")
    replaying = argparse.ArgumentParser(add_help=False)
    replaying.add_argument("--step", type=int, help="step to rebuild (default: newest durable)")
    replaying.add_argument("--allow-module", action="append", default=["torch."], metavar="MODULE",
                           help="also import optimizer classes from MODULE (default: torch.)")
    replaying.add_argument("--device", default=None,
                           help="replay on this device (default: the device type the run trained on, the only "
                                "one that gives a bit-exact result; refused where there is none)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON for scripts")
    return {"common": common, "storage": storage, "replaying": replaying, "json": as_json}


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; only ``command``'s module is imported for its own arguments."""
    parser = argparse.ArgumentParser(
        prog="diffckpt", description="Inspect, verify and export diffckpt runs; plan their settings.",
        epilog="exit codes: 0 ok, 1 damage or failed operation, 2 usage error, no such run/step")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups = _groups()
    for name, (text, parents) in _COMMANDS.items():
        p = sub.add_parser(name, parents=[groups[g] for g in parents], help=text, description=text)
        if name == command:
            module = importlib.import_module(f".{name}", __name__)
            if hasattr(module, "add_arguments"):
                module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    # The top level takes no option with a value: the first word that is not an option is the command.
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``diffckpt`` command line and return its exit code.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 when damage is found or an operation fails, 2 on usage errors and when
        the run or step does not exist.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser(_command(argv)).parse_args(argv)
    except SystemExit as exc:  # argparse exits; in-process callers want a return code
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        if args.command not in _REPLAYING:
            return int(args.func(args))
        from ..replay import replay_progress  # imports torch, which these commands need anyway
        from .common import Progress

        with Progress("replaying", unit="step") as bar, replay_progress(bar.update_to):
            return int(args.func(args))
    except (CheckpointNotFoundError, UnsupportedConfigurationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DiffCkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except json.JSONDecodeError as exc:  # session and run files carry no checksum of their own
        print(f"error: a JSON file of the run is damaged: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `diffckpt ls URL | head` closed stdout: stop quietly, as a SIGPIPE would.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
