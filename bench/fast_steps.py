"""Fast training steps emulated on the CPU: what a diff every step costs when the device computes
and the training thread waits, and what a crash loses.

On a GPU the training thread spends most of a step idle, waiting for the device. Here that
device time is a ``time.sleep(--device-ms)``, and the gradients are REAL: a GPT-2
(``transformers.GPT2LMHeadModel`` from a ``GPT2Config``, no download; by default 4 layers x 384
wide, 26.4M parameters) runs forward and backward under bf16 autocast on the CPU before any
clock starts, for ``--grad-sets`` distinct batches (random tensors would compress differently and
hide what zstd costs). Each timed step then does what a GPU loop's training thread does around
the device's work:

    optimizer.zero_grad(set_to_none=True)
    p.grad = <the step's precomputed gradient>.clone()   # for every parameter; sets cycled
    optimizer.step()                                      # SGD (--momentum)
    engine.commit(step, source)                           # the checkpoint call (none: skipped)
    time.sleep(device_ms / 1000)                          # the device's time, the thread idle

The run root is storage slower than the records: ``--storage paced`` (the default) is local disk
behind a link of ``--mbps`` MB/s (each write takes at least its bytes over that rate), with the
open segments' spools in the node-local tier's folder as on an object store; ``--storage local``
is plain local disk (spools beside their segments, commits by rename).

Configurations are ``CheckpointOptions`` keyword arguments, given on the command line:
``--config NAME:key=value,key=value`` (values read as Python literals, else as strings:
``compression=none`` is the string, ``local_dir=None`` is None). ``none`` is the loop without
checkpointing, the baseline every ratio is taken against (same device time, same round). The
defaults: ``none``, ``defaults`` (``CheckpointOptions()``) and ``no-compression``
(``compression=none``). A configuration naming an option this checkout's ``CheckpointOptions``
does not have (``durability=...`` before it lands) is skipped with a note in the report.

Per configuration and device time, each run a fresh process: s/step over the timed steps and its
ratio to ``none``; the same with the final flush (``engine.end()``); bytes written to the run
root per step; peak RSS (``ru_maxrss``); at the loop's end the durable step (the run root) and the
node-local step (the journal), each as a lag in steps and in seconds (how long before the loop's
end the step they hold was committed); the writer's stall seconds (training waiting for it) and
write seconds (``WriterStats``).

The children run with glibc's large allocations cached (``MALLOC_CACHE``; ``--no-malloc-cache``):
a GPU loop's fresh gradients come from the caching allocator, not from pages mapped anew.

``--kill`` is the correctness mode instead (SGD with momentum 0.9 there, so that the optimizer has
state to compare): for each diffckpt configuration, a run that never imports diffckpt (the
reference), then a run killed with SIGKILL (it and every descendant) at
step ``--kill-at`` of ``--kill-steps`` and resumed (``engine.resume``) to the end, compared with
``torch.equal`` on every tensor of the model and optimizer; and the same with the node-local
tier's folder deleted before the resume (the job resumed on another node, from the run root
alone). Reported: the step killed at, the durable and node-local steps the run had printed last,
the step resumed from, steps lost, bitwise equality; a row fails when the resume differs or lost
more steps than the run stated for that failure (its last statement before the kill: the bound is
stated at the first step and again as the measurements settle, ``lossbound.Restating``).

    python bench/fast_steps.py [--device-ms 150,60] [--steps 40] [--config NAME:k=v,...]...
                               [--storage paced --mbps 100] [--out bench/results/fast-steps.json]
    python bench/fast_steps.py --kill [--kill-steps 30 --kill-at 18]   # bench/results/fast-steps-kill.json
    python bench/fast_steps.py --size toy --steps 4 --device-ms 5       # a check of the script
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests")]

SIZES = {  # GPT2Config: n_layer, n_embd, n_head, vocab, tokens per sequence of a gradient batch
    "26m": (4, 384, 6, 50257, 64),
    "toy": (2, 64, 2, 512, 32),  # the smoke test
}
NONE = "none"
# glibc maps every allocation above 32 MiB afresh and faults it in page by page: here the 77 MB
# embedding gradient cost 100-180 ms a step to clone. A GPU loop's fresh gradients come from the
# caching allocator instead; with these, freed memory is reused the same way (--no-malloc-cache).
MALLOC_CACHE = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 35)}
DEFAULT_CONFIGS = [NONE, "defaults", "no-compression:compression=none"]


# --------------------------------------------------------------------------- configurations
def parse_value(text: str) -> Any:
    """A Python literal where ``text`` is one (``8``, ``None``, ``1.5``, ``'x'``), else the text."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_config(text: str) -> tuple[str, dict[str, Any] | None]:
    """``NAME[:key=value,...]`` as ``(name, CheckpointOptions kwargs)``; ``none``: ``(none, None)``."""
    name, _, rest = text.partition(":")
    if name == NONE:
        if rest:
            raise ValueError("the 'none' configuration takes no options")
        return NONE, None
    kwargs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{text!r}: options are key=value, got {item!r}")
        kwargs[key.strip()] = parse_value(value.strip())
    return name, kwargs


def options_problem(kwargs: dict[str, Any]) -> str | None:
    """Why ``CheckpointOptions(**kwargs)`` cannot be built in this checkout, or ``None``."""
    from diffckpt import CheckpointOptions

    fields = {f.name for f in dataclasses.fields(CheckpointOptions)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        return f"CheckpointOptions has no {', '.join(unknown)} in this checkout"
    try:
        CheckpointOptions(**kwargs)
    except (TypeError, ValueError) as exc:
        return f"CheckpointOptions refuses it: {exc}"
    return None


def local_folder(kwargs: dict[str, Any], url: str) -> str | None:
    """The node-local tier's folder of the run root at ``url`` under these options (``None``: no tier)."""
    from diffckpt import CheckpointOptions
    from diffckpt.journal import journal_folder, resolve_local_dir

    local_dir = CheckpointOptions(**kwargs).local_dir
    return None if local_dir is None else journal_folder(resolve_local_dir(local_dir), url)


# ---------------------------------------------------------------------------------- storage
class PacedStorage:
    """The run root on local disk as a durable tier slower than the records: each write takes at
    least its bytes over ``mbps`` MB/s (the link is one: the writer commits one object at a time).
    The open segments' spools go to the node-local tier's folder, as on an object store, so that
    the run root holds only what is committed. ``mbps=None``: plain local disk, spools beside
    their segments (``FsspecStorage``'s). Counts the bytes and seconds of every write."""

    def __init__(self, root: str, mbps: float | None) -> None:
        from diffckpt.storage import FsspecStorage

        self.inner = FsspecStorage(root)
        self.url = self.inner.url
        self.rate = mbps * 1e6 if mbps else None
        self.bytes_written = 0
        self.write_seconds = 0.0
        self._lock = threading.Lock()

    def spool(self, hint: str, folder: str | None = None) -> Any:
        if self.rate is None:
            return self.inner.spool(hint, folder)
        from diffckpt.storage.spool import temporary_spool

        return temporary_spool(hint, folder)

    def _paced(self, n: int, write: Any) -> Any:
        with self._lock:
            t0 = time.monotonic()
            out = write()
            if self.rate is not None:
                time.sleep(max(0.0, n / self.rate - (time.monotonic() - t0)))
            self.bytes_written += n
            self.write_seconds += time.monotonic() - t0
        return out

    def write(self, path: str, data: Any) -> None:
        from diffckpt.storage.protocol import data_size

        self._paced(data_size(data), lambda: self.inner.write(path, data))

    def create(self, path: str, data: bytes) -> bool:
        return bool(self._paced(len(data), lambda: self.inner.create(path, data)))

    def read(self, path: str) -> bytes:
        return self.inner.read(path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self.inner.read_range(path, start, end)

    @property
    def ranged(self) -> bool:
        return bool(getattr(self.inner, "ranged", False))

    def list(self, prefix: str) -> dict[str, int]:
        return self.inner.list(prefix)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def details(self, prefix: str, hidden: bool = False) -> dict[str, tuple[int, float | None]]:
        return self.inner.details(prefix, hidden)

    def stat(self, path: str) -> tuple[int, float | None]:
        return self.inner.stat(path)

    def incomplete_uploads(self) -> list[tuple[str, str, float | None]]:
        return self.inner.incomplete_uploads()

    def abort_upload(self, path: str, upload_id: str) -> None:
        self.inner.abort_upload(path, upload_id)


# ------------------------------------------------------------------------------ gradients
def gradients(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """The model's initial parameters and ``--grad-sets`` real gradient sets (GPT-2 forward and
    backward under bf16 autocast on the CPU, one batch each), saved to ``path``; untimed."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    layers, dim, heads, vocab, ctx = SIZES[args.size]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=max(ctx, 128),
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    model = GPT2LMHeadModel(cfg)
    names = [n for n, _ in model.named_parameters()]
    init = [p.detach().clone() for p in model.parameters()]
    sets = []
    t0 = time.perf_counter()
    for k in range(args.grad_sets):
        g = torch.Generator().manual_seed(100 + k)
        ids = torch.randint(0, vocab, (args.batch, ctx), generator=g)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        sets.append([p.grad.detach().clone() for p in model.parameters()])
    seconds = time.perf_counter() - t0
    data = {"names": names, "init": init, "grads": sets}
    torch.save(data, path)
    return {"params": sum(p.numel() for p in init), "tensors": len(init), "seconds": seconds}


def load_model(path: str, momentum: float) -> tuple[Any, Any, list[list[Any]]]:
    """The model as its parameters alone (GPT-2's names, the saved initial values), SGD, and the
    gradient sets: a timed run needs no forward pass, and no transformers."""
    import torch

    data = torch.load(path, weights_only=True)
    model = torch.nn.Module()
    for name, value in zip(data["names"], data["init"]):
        *parents, leaf = name.split(".")
        owner = model
        for part in parents:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(value))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=momentum)
    return model, opt, data["grads"]


# ---------------------------------------------------------------------------------- a run
class Source:
    """The loop's FrameworkState: nothing beyond model and optimizer (a step's data is its number)."""

    def rank_state(self) -> Any:
        return None

    def state(self, ranks: list[Any]) -> Any:
        return {}


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def thread_cpu() -> dict[str, float]:
    """CPU seconds each live Python thread has used (``/proc``; empty elsewhere), by name with
    the session and worker numbers dropped (``diffckpt-commit-g1`` and ``-g2`` are one row), and
    the whole process's (``process``: threads that ended count there only)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        name = re.sub(r"(-g\d+|_\d+)$", "", t.name)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread's, those that ended too
    out["process"] = usage.ru_utime + usage.ru_stime
    return out


def tiers(engine: Any) -> tuple[int | None, int | None]:
    """``(durable step, node-local step)`` of the running session, from the metrics loggers get."""
    m = engine.metrics()
    durable, local = m.get("diffckpt/durable_step"), m.get("diffckpt/local_step")
    return (None if durable is None else int(durable)), (None if local is None else int(local))


def writer_figures(writer: Any) -> dict[str, Any]:
    """The writer's counters (``WriterStats``: stall and write seconds, bytes), where it has them."""
    stats = getattr(writer, "stats", None)
    if stats is None or not dataclasses.is_dataclass(stats):
        return {}
    return {k: v for k, v in dataclasses.asdict(stats).items() if isinstance(v, (int, float))}


_LAUNCH = None  # (source, output) of the small op each emulated kernel launch is


def launch(n: int) -> None:
    """``n`` small torch ops from Python: what a GPU loop's training thread does while the device
    computes (each call drops and takes back the GIL, as a kernel launch does)."""
    global _LAUNCH
    import torch

    if _LAUNCH is None:
        _LAUNCH = (torch.ones(8), torch.empty(8))
    x, y = _LAUNCH
    for _ in range(n):
        torch.add(x, 1, out=y)


def calibrate_launches(seconds: float) -> int:
    """How many :func:`launch` ops take ``seconds`` on this machine before anything else runs."""
    if seconds <= 0:
        return 0
    launch(2000)
    began = time.perf_counter()
    launch(20000)
    return max(1, round(20000 * seconds / (time.perf_counter() - began)))


def device_time(seconds: float, launches: int) -> None:
    """The device's time of a step: ``launches`` ops issued from Python first (``--launch-ms``;
    they take longer when other threads hold the GIL), then idle until ``seconds`` from the start,
    as a GPU runs the step while its kernels are being launched."""
    began = time.perf_counter()
    launch(launches)
    left = seconds - (time.perf_counter() - began)
    if left > 0:
        time.sleep(left)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One run (``spec["mode"]``: ``timed``, ``kill`` (prints STEP lines to be killed at),
    ``resume`` or ``reference``); returns its figures, saves the final state to ``spec["final"]``."""
    import torch

    torch.set_num_threads(spec["threads"])
    model, opt, grads = load_model(spec["grads"], spec["momentum"])
    params = list(model.parameters())
    engine = storage = None
    source = Source()
    start = 0
    if spec["kwargs"] is not None:
        from diffckpt import CheckpointEngine, CheckpointOptions

        storage = PacedStorage(spec["root"], spec["mbps"])
        engine = CheckpointEngine(storage, CheckpointOptions(**spec["kwargs"]))
        if spec["mode"] == "resume":
            restored = engine.resume(model, [opt], missing_ok=True)
            start = restored.step if restored is not None else 0
        engine.begin(model, [opt], start, source)
    print(f"START {start}", flush=True)
    last, warmup, pause = spec["last"], spec["warmup"], spec["device_ms"] / 1000
    launches = calibrate_launches(spec.get("launch_ms", 0.0) / 1000)
    committed: dict[int, float] = {0: time.perf_counter()}
    t0, cpu0 = time.perf_counter(), thread_cpu()
    stated: Any = None
    for n in range(start + 1, last + 1):
        if n == warmup + 1:
            t0, cpu0 = time.perf_counter(), thread_cpu()
        opt.zero_grad(set_to_none=True)
        for p, g in zip(params, grads[n % len(grads)]):
            p.grad = g.clone()
        opt.step()
        if engine is not None:
            engine.commit(n, source)
        committed[n] = time.perf_counter()
        if spec["mode"] != "timed":
            durable, local = tiers(engine) if engine is not None else (None, None)
            print(f"STEP {n} durable {durable} local {local}", flush=True)
            bound = getattr(getattr(getattr(engine, "recorder", None), "writer", None), "loss", None)
            if bound is not None and bound is not stated:  # what the run says each failure loses, as it says it
                print(f"BOUND crash {bound.crash_steps} node {bound.node_steps}: {bound.text}", flush=True)
                stated = bound
        device_time(pause, launches)
    t_loop, cpu1 = time.perf_counter(), thread_cpu()
    out: dict[str, Any] = {"start": start, "last": last, "imported_diffckpt": "diffckpt" in sys.modules}
    # CPU each thread spent a timed step (threads that ended inside the loop are not counted)
    out["cpu_ms_per_step"] = {k: round(1000 * (v - cpu0.get(k, 0.0)) / max(1, last - max(warmup, start)), 1)
                              for k, v in cpu1.items() if v - cpu0.get(k, 0.0) > 0}
    if engine is not None:
        durable, local = tiers(engine)
        out.update(durable_at_loop_end=durable, local_at_loop_end=local,
                   max_pending_bytes=engine.options.max_pending_bytes)
        for name, step in (("durable", durable), ("local", local)):
            out[f"{name}_lag_steps"] = None if step is None else last - step
            out[f"{name}_lag_s"] = None if step is None else t_loop - committed.get(step, committed[0])
        writer = getattr(engine.recorder, "writer", None)  # the session's, gone from the engine after end()
        engine.end()
        out["writer"] = writer_figures(writer)
    t_end = time.perf_counter()
    timed = last - max(warmup, start)
    out.update(steps=timed, loop_s=t_loop - t0, total_s=t_end - t0, flush_s=t_end - t_loop,
               s_per_step=(t_loop - t0) / timed, s_per_step_with_flush=(t_end - t0) / timed, rss_peak=rss_peak(),
               bytes_written=storage.bytes_written if storage is not None else 0,
               bytes_per_step=(storage.bytes_written / last) if storage is not None else 0,
               storage_write_s=storage.write_seconds if storage is not None else 0.0)
    if spec.get("final"):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, spec["final"])
    return out


# ------------------------------------------------------------------------------- the parent
def spawn(spec: dict[str, Any], timeout: float, kill_at: int | None = None) -> tuple[int | None, str]:
    """Run a child process with ``spec``; with ``kill_at``, SIGKILL it and every descendant once
    it prints ``STEP <n>`` with ``n >= kill_at``. Returns ``(exit code, output)``."""
    from helpers import kill_tree, read_output

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(spec["threads"]),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if spec["malloc_cache"]:
        env.update(MALLOC_CACHE)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=ROOT)
    timer = threading.Timer(timeout, lambda: kill_tree(proc.pid))
    timer.start()
    try:
        lines = read_output(proc, kill_at, drain=True)
        rc: int | None = proc.wait()
    finally:
        timer.cancel()
    return rc, "".join(lines)


def result_of(rc: int | None, log: str, what: str) -> dict[str, Any]:
    found = [line[len("RESULT "):] for line in log.splitlines() if line.startswith("RESULT ")]
    if rc != 0 or not found:
        raise RuntimeError(f"{what} failed (exit {rc}): {log[-1500:]}")
    return dict(json.loads(found[-1]))


def base_spec(args: argparse.Namespace, grads: str) -> dict[str, Any]:
    return {"grads": grads, "threads": args.threads, "mbps": args.mbps if args.storage == "paced" else None,
            "warmup": args.warmup, "malloc_cache": args.malloc_cache, "launch_ms": args.launch_ms,
            "momentum": args.momentum if args.momentum is not None else (0.9 if args.kill else 0.0)}


def timed(args: argparse.Namespace, configs: list[tuple[str, dict[str, Any] | None]], grads: str,
          workdir: str) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    runnable = []
    for name, kwargs in configs:
        problem = None if kwargs is None else options_problem(kwargs)
        if problem:
            skipped[name] = problem
            print(f"skipped {name}: {problem}", flush=True)
        else:
            runnable.append((name, kwargs))
    for rnd in range(args.rounds):
        for device_ms in args.device_ms:
            shift = rnd % len(runnable)
            for name, kwargs in runnable[shift:] + runnable[:shift]:
                root = tempfile.mkdtemp(prefix=f"fast-{name}-", dir=workdir)
                spec = {**base_spec(args, grads), "mode": "timed", "kwargs": kwargs, "root": root,
                        "device_ms": device_ms, "last": args.warmup + args.steps}
                try:
                    r = result_of(*spawn(spec, args.timeout), name)
                except RuntimeError as exc:
                    r = {"error": str(exc)}
                    print(f"--- {name} failed: {exc}", flush=True)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                r.update(config=name, kwargs=kwargs, device_ms=device_ms, round=rnd)
                runs.append(r)
                if "error" not in r:
                    print(f"round {rnd + 1} {device_ms:5.0f} ms {name:18s} {r['s_per_step']:7.3f} s/step "
                          f"(+flush {r['s_per_step_with_flush']:7.3f})  {r['bytes_per_step'] / 1e6:7.1f} MB/step  "
                          f"RSS {r['rss_peak'] / 1e6:6.0f} MB  durable {r.get('durable_at_loop_end')} "
                          f"local {r.get('local_at_loop_end')} of {r['last']}\n    CPU ms a step by thread: "
                          + ", ".join(f"{k} {v:g}" for k, v in sorted(r.get("cpu_ms_per_step", {}).items())),
                          flush=True)
    for r in runs:
        base = next((b for b in runs if b["config"] == NONE and b["round"] == r["round"]
                     and b["device_ms"] == r["device_ms"] and "error" not in b), None)
        if base is not None and "error" not in r:
            r["ratio"] = r["s_per_step"] / base["s_per_step"]
            r["ratio_with_flush"] = r["s_per_step_with_flush"] / base["s_per_step_with_flush"]
            r["rss_over_none"] = r["rss_peak"] - base["rss_peak"]
    return {"runs": runs, "skipped": skipped}


def kill(args: argparse.Namespace, configs: list[tuple[str, dict[str, Any] | None]], grads: str,
         workdir: str) -> dict[str, Any]:
    """Every (configuration, scenario) killed and resumed, against one reference run. They run at
    once, the reference beside them: each is a run root and a node-local folder of its own, what is
    measured is exactness (not time), and process start-up is most of a small run's time."""
    import torch

    device_ms = args.device_ms[0]
    common = {**base_spec(args, grads), "device_ms": device_ms, "last": args.kill_steps, "warmup": 0}
    reference = os.path.join(workdir, "reference.pt")
    todo, skipped = [], {}
    for name, kwargs in configs:
        if kwargs is None:
            continue
        problem = options_problem(kwargs)
        if problem:
            skipped[name] = problem
        else:
            todo += [(name, kwargs, scenario) for scenario in ("process crash", "local tier gone")]
    with ThreadPoolExecutor(len(todo) + 1) as pool:
        pending = pool.submit(spawn, {**common, "mode": "reference", "kwargs": None, "root": None,
                                      "final": reference}, args.timeout)
        runs = [pool.submit(kill_one, args, common, workdir, *job) for job in todo]
        ref = result_of(*pending.result(), "the reference run")
        if ref["imported_diffckpt"]:
            raise RuntimeError("the reference run imported diffckpt")
        truth = torch.load(reference, weights_only=True)
        rows = [compare_row(run.result(), truth) for run in runs]
    for row in rows:
        print(f"kill {row['config']:18s} {row['scenario']:16s} {row['status']:7s} killed at {row.get('killed_at')} "
              f"(durable {row.get('durable_printed')}, local {row.get('local_printed')}), resumed from "
              f"{row.get('resumed_from')}: {row.get('steps_lost')} steps lost, bitwise {row.get('bitwise')}"
              + (f" ({row['note'][:300]})" if row.get("note") else ""), flush=True)
    return {"rows": rows, "skipped": skipped, "reference": ref, "kill_steps": args.kill_steps,
            "kill_at": args.kill_at, "device_ms": device_ms}


def kill_one(args: argparse.Namespace, common: dict[str, Any], workdir: str, name: str, kwargs: dict[str, Any],
             scenario: str) -> dict[str, Any]:
    """A run of ``kwargs`` killed with SIGKILL at ``--kill-at``, then (``local tier gone``: after
    its node-local folder was deleted) resumed to the end in a new process; its final state is
    left in ``row["final"]``."""
    root = tempfile.mkdtemp(prefix=f"kill-{name}-", dir=workdir)
    row: dict[str, Any] = {"config": name, "kwargs": kwargs, "scenario": scenario, "device_ms": common["device_ms"]}
    folder = local_folder(kwargs, PacedStorage(root, None).url)
    if scenario == "local tier gone" and folder is None:
        shutil.rmtree(root, ignore_errors=True)
        return {**row, "status": "skipped", "note": "no node-local tier (local_dir=None)"}
    final = root + "-final.pt"
    try:
        spec = {**common, "kwargs": kwargs, "root": root}
        rc, log = spawn({**spec, "mode": "kill"}, args.timeout, kill_at=args.kill_at)
        steps = [line.split() for line in log.splitlines() if line.startswith("STEP ")]
        if rc != -9 or not steps:
            raise RuntimeError(f"the run to kill ended with {rc}: {log[-1500:]}")
        last = max(steps, key=lambda s: int(s[1]))
        row["killed_at"] = int(last[1])
        row["durable_printed"], row["local_printed"] = parse_value(last[3]), parse_value(last[5])
        # the statement in force when it was killed: the last one printed
        bound = next((line.split() for line in reversed(log.splitlines()) if line.startswith("BOUND ")), None)
        if bound is not None:
            row["stated_crash_steps"], row["stated_node_steps"] = parse_value(bound[2]), parse_value(bound[4].rstrip(":"))
            row["stated"] = " ".join(bound[5:])
        if scenario == "local tier gone" and folder is not None:  # another node: no spool, no journal
            shutil.rmtree(folder, ignore_errors=True)
        resumed = result_of(*spawn({**spec, "mode": "resume", "final": final}, args.timeout), "the resume")
        row["resumed_from"] = resumed["start"]
        row["steps_lost"] = row["killed_at"] - resumed["start"]
        row["final"] = final
    except RuntimeError as exc:
        row.update(status="failed", note=str(exc)[:1500])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return row


def compare_row(row: dict[str, Any], truth: Any) -> dict[str, Any]:
    """``row`` with its resumed state compared with ``torch.equal`` on every tensor of ``truth``."""
    import torch
    from helpers import assert_bitwise_equal, count_tensors

    final = row.pop("final", None)
    if final is None:
        return row
    try:
        assert_bitwise_equal(torch.load(final, weights_only=True), truth)
        row["bitwise"], row["status"] = True, "passed"
        stated = row.get("stated_crash_steps" if row["scenario"] == "process crash" else "stated_node_steps")
        if isinstance(stated, int) and isinstance(row.get("steps_lost"), int) and row["steps_lost"] > stated:
            row["status"], row["note"] = "failed", f"lost {row['steps_lost']} steps, more than the {stated} stated"
    except AssertionError as exc:
        row["bitwise"], row["status"], row["note"] = False, "failed", str(exc)[:400]
    finally:
        os.remove(final)
    row["tensors"] = count_tensors(truth)
    return row


# ---------------------------------------------------------------------------------- report
def fmt(x: Any, spec: str, none: str = "—") -> str:
    return none if x is None else format(x, spec)


def report(data: dict[str, Any]) -> list[str]:
    m = data["machine"]
    lines = [f"# Fast steps emulated on the CPU ({data['date']}, commit {data['commit']})", "",
             f"{m['cores']} cores, torch threads {data['args']['threads']}, Python {m['python']}, torch {m['torch']}; "
             f"GPT-2 {data['args']['size']} ({data['model']['params'] / 1e6:.1f}M parameters), SGD "
             f"(momentum {data['momentum']:g}), malloc cache {'on' if data['args']['malloc_cache'] else 'off'}, "
             f"{data['args']['grad_sets']} gradient sets of batch {data['args']['batch']}; storage "
             + (f"paced to {data['args']['mbps']:g} MB/s" if data["args"]["storage"] == "paced" else "local disk")
             + "."]
    if "timed" in data:
        t = data["timed"]
        lines += ["", "| device ms | config | s/step | vs none | with flush | vs none | bytes/step | peak RSS | "
                  "durable / local step at loop end (of) | lag s durable / local | writer stall s | final flush s |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]
        for r in t["runs"]:
            if "error" in r:
                lines.append(f"| {r['device_ms']:g} | {r['config']} | failed | | | | | | | | | |")
                continue
            ck = r["config"] != NONE
            lines.append(
                f"| {r['device_ms']:g} | {r['config']} | {r['s_per_step']:.3f} | {fmt(r.get('ratio'), '.2f')}× | "
                f"{r['s_per_step_with_flush']:.3f} | {fmt(r.get('ratio_with_flush'), '.2f')}× | "
                f"{r['bytes_per_step'] / 1e6:.1f} MB | {r['rss_peak'] / 1e6:,.0f} MB | "
                + (f"{r.get('durable_at_loop_end')} / {r.get('local_at_loop_end')} ({r['last']}) | "
                   f"{fmt(r.get('durable_lag_s'), '.1f')} / {fmt(r.get('local_lag_s'), '.1f')} | "
                   f"{fmt(r.get('writer', {}).get('stall_seconds'), '.1f')} | {r['flush_s']:.1f} |"
                   if ck else "— | — | — | — |"))
        lines += [f"- {name} skipped: {why}" for name, why in t["skipped"].items()]
    if "kill" in data:
        k = data["kill"]
        lines += ["", f"kill -9 at step {k['kill_at']} of {k['kill_steps']}, device time {k['device_ms']:g} ms, "
                  "every tensor compared with `torch.equal` against a run without diffckpt:", "",
                  "| config | scenario | outcome | killed at | durable / local step printed last | resumed from | "
                  "steps lost | stated bound (steps) | tensors |", "|---|---|---|---:|---|---:|---:|---:|---:|"]
        for r in k["rows"]:
            stated = r.get("stated_crash_steps" if r["scenario"] == "process crash" else "stated_node_steps", "—")
            lines.append(f"| {r['config']} | {r['scenario']} | {r['status']} | {r.get('killed_at', '—')} | "
                         f"{r.get('durable_printed', '—')} / {r.get('local_printed', '—')} | "
                         f"{r.get('resumed_from', '—')} | {r.get('steps_lost', '—')} | {stated} | "
                         f"{r.get('tensors', '—')} |")
        lines += [f"- {name} skipped: {why}" for name, why in k["skipped"].items()]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="26m", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=1, help="sequences per gradient batch (default 1)")
    ap.add_argument("--grad-sets", type=int, default=4, help="distinct gradient sets, cycled (default 4)")
    ap.add_argument("--device-ms", default="150,60", help="emulated device times per step, ms (default 150,60)")
    ap.add_argument("--launch-ms", type=float, default=0.0,
                    help="of each step's device time, ms the training thread spends launching small ops from "
                    "Python, as a GPU loop launches kernels (default 0: all of it idle)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--config", action="append", help="NAME[:key=value,...] of CheckpointOptions; repeatable "
                    f"(default: {' '.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--storage", default="paced", choices=["paced", "local"])
    ap.add_argument("--mbps", type=float, default=100.0, help="the paced storage's MB/s (default 100)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training process (default 1)")
    ap.add_argument("--momentum", type=float, help="SGD's momentum (default 0; with --kill 0.9, so that the "
                    "optimizer has state to compare)")
    ap.add_argument("--no-malloc-cache", dest="malloc_cache", action="store_false",
                    help="glibc's own large allocations (see MALLOC_CACHE)")
    ap.add_argument("--kill", action="store_true", help="the correctness mode: kill -9 and resume")
    ap.add_argument("--kill-steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=18)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a child may run")
    ap.add_argument("--grads", help="the gradient file to use or make (default: one in the work dir)")
    ap.add_argument("--workdir", help="parent of the run roots (default: a temporary folder, removed)")
    ap.add_argument("--out", help="JSON results (default bench/results/fast-steps[-kill].json)")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    args.device_ms = [float(x) for x in args.device_ms.split(",")]
    configs = [parse_config(c) for c in (args.config or DEFAULT_CONFIGS)]
    if args.kill and not any(k is not None for _, k in configs):
        ap.error("--kill needs a diffckpt configuration")
    if not args.kill and NONE not in [n for n, _ in configs]:
        ap.error("the 'none' configuration is the baseline: name it")
    import torch

    workdir = args.workdir or tempfile.mkdtemp(prefix="diffckpt-fast-steps-")
    os.makedirs(workdir, exist_ok=True)
    grads = args.grads or os.path.join(workdir, "grads.pt")
    data: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "processor": platform.processor() or platform.machine()},
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "momentum": base_spec(args, grads)["momentum"], "load_before": os.getloadavg(),
    }
    try:
        if os.path.exists(grads):
            data["model"] = {"params": sum(t.numel() for t in torch.load(grads, weights_only=True)["init"]),
                             "from": grads}
        else:
            print(f"computing {args.grad_sets} gradient sets (GPT-2 {args.size}, bf16 autocast, batch {args.batch}) ...",
                  flush=True)
            data["model"] = gradients(args, grads)
            print(f"... {data['model']['params'] / 1e6:.1f}M parameters, {data['model']['seconds']:.0f} s", flush=True)
        if args.kill:
            data["kill"] = kill(args, configs, grads, workdir)
        else:
            data["timed"] = timed(args, configs, grads, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    out = args.out or os.path.join(ROOT, "bench", "results", "fast-steps-kill.json" if args.kill else "fast-steps.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(data, f, indent=1)
    print("\n" + "\n".join(report(data)) + f"\n\nresults in {out}")
    failed = [r for r in data.get("kill", {}).get("rows", []) if r["status"] == "failed"]
    return 1 if failed else 0


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
