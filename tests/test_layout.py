"""The package's layout: no import circle in the core or any adapter package (function-level
and type-only imports included), module sizes, and the engine's public surface built by composition."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["diffckpt", "lightning_ckpt", "accelerate_ckpt", "transformers_ckpt"]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def _imports(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``mod`` imports anywhere in its code (functions too), type-only imports
    (under ``if TYPE_CHECKING:``) as well: a helper types what it is handed by a protocol of what
    it uses, not by its caller's class. A parent package of ``mod`` does not count (Python
    imports it first)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):
                found.add(name)
    return found


def test_no_import_circle_anywhere():
    known = _modules()
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    circles = []
    for start in graph:  # a path back to ``start`` through what it imports
        seen, stack = set(), [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, "import circles:\n" + "\n".join(sorted(circles))


def test_modules_stay_small():
    """Core modules split by responsibility past 400 lines; adapters translate, and logic past
    320 lines belongs in the core."""
    big = {str(p.relative_to(ROOT)): n for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
           if (n := len(p.read_text().splitlines())) > (400 if pkg == "diffckpt" else 320)}
    assert not big, f"modules over their size (core 400 lines, adapters 320): {big}"


def test_the_engine_holds_its_parts_instead_of_inheriting_them():
    from diffckpt import CheckpointEngine
    from diffckpt.recorder import Recorder

    assert CheckpointEngine.__mro__ == (CheckpointEngine, object)
    public = {n for n, _ in inspect.getmembers(CheckpointEngine) if not n.startswith("_")}
    # The writer's internals are the recorder's, not the engine's public surface.
    assert not public & {"writer", "capture", "tuning", "maintenance", "store", "stream", "join", "follow",
                         "review", "review_due", "adopt"}
    assert {"resume", "begin", "commit", "make_restorable", "end", "restore", "start", "record_step",
            "write_base", "flush", "close", "recorder", "metrics"} <= public | {"recorder"}
    assert "restore" in vars(Recorder)


def test_adapters_use_the_declared_toolkit_only():
    """Adapters import the core through ``diffckpt.integration`` (and the public ``diffckpt`` and
    ``diffckpt.errors``; ``diffckpt.extras`` in their ``__init__``, before the framework)."""
    allowed = {"diffckpt", "diffckpt.errors", "diffckpt.integration", "diffckpt.extras"}
    found = {}
    for pkg in PACKAGES[1:]:
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("diffckpt"):
                    if node.module not in allowed:
                        found[f"{f.relative_to(ROOT)}:{node.lineno}"] = node.module
                elif isinstance(node, ast.Import):
                    found.update({f"{f.relative_to(ROOT)}:{node.lineno}": a.name for a in node.names
                                  if a.name.startswith("diffckpt.") and a.name not in allowed})
    assert not found, f"adapters reach past diffckpt.integration: {found}"


def test_the_integration_toolkit_is_pinned():
    import diffckpt.integration as integration

    assert sorted(integration.__all__) == sorted([
        "END", "HF_TRAINER_KEY", "NOT_GIVEN_BASE_EVERY_N_STEPS", "NOT_GIVEN_EVERY_N_STEPS", "NOT_GIVEN_WRITE_BATCH",
        "RUN_FILE", "Auto", "ByBytes", "CheckpointEngine", "CheckpointOptions", "Codec", "Committed", "FrameworkState",
        "FsspecStorage", "GradientCompressor", "IndexSampler", "LoopCheckpointer", "NotGiven", "Remainder",
        "ReplayResult", "StepDriver", "deal", "distributed_dealing", "drawn_order", "global_order",
        "StopSignal", "TrackedLoader", "check_codec", "check_log_every", "check_replayable", "epoch_start_state",
        "get_rng_state", "is_sharded", "merge_options", "open_storage", "require_extra", "set_epoch_start_state",
        "set_rng_state", "step_metrics"])
    assert all(hasattr(integration, name) for name in integration.__all__)
