"""Gradients a record takes over from training without a copy, and the guard that makes it safe.

After ``optimizer.step()`` a record needs the gradients the step consumed. Copying them costs a
full pass over the gradient bytes on the training thread (and, on a GPU, device memory until
the writer is done). Most training drops its gradients after the step
(``zero_grad(set_to_none=True)``, the default of PyTorch, Lightning, Accelerate and the
``Trainer``): the next backward then allocates fresh ones, and the old tensors are nobody's but
the record's. A record may then keep them as they are. It must never keep one that training
goes on to change in place: ``zero_grad(set_to_none=False)``, gradients accumulated across
steps, or user code.

So a gradient is taken in one of two ways:

* **leased**: the record holds the tensor itself. The lease ends when training lets go of it
  (``param.grad`` is no longer that tensor, nothing else holds it, and its version counter has not
  moved), or when training is about to change it in place, in which case it is copied first.
  The writer does not wait for that: it reads a record's gradients as soon as it takes the record
  (:func:`reading`), which a copy or a change in place by training waits for, and journals the
  record once every lease ended cleanly (:meth:`Lease.wait`). A loop lets go of a step's
  gradients only when the next step begins, after the device's time: waiting for that would
  leave the writer the host's few milliseconds of a step to write a record in, and training
  would wait for it at the next commit.
* **copied** (foreach copies): always for gradients that alias memory training reuses (views,
  such as DDP's ``gradient_as_bucket_view`` buckets, and storage shared with anything else), for
  sharded (``DTensor``) gradients, and for every gradient of an optimizer until this run has
  shown that it lets its gradients go cleanly (``TRUST_AFTER`` steps in a row).

The points where training may change a gradient in place are watched: the optimizer's
``zero_grad`` (wrapped on the instance), a tensor hook on every parameter (it runs before the
next backward accumulates into ``.grad``), and the next ``optimizer.step()``. Waits for the
writer (a full queue, a flush) first end every lease, copying what is still attached, so
training never waits on a lease.

What cannot be watched: code that changes a gradient through ``.data`` or numpy, or through a
view of it kept past the step, after the lease ended. A change made while the lease runs moves
the version counter and is caught when the lease ends (:class:`GradientMutatedError`: the record
is not journaled, nor written). Training that does such things sets ``CheckpointOptions(copy_gradients=True)``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .errors import DiffCkptError, GradientMutatedError
from .staging import HostStage

__all__ = ["TRUST_AFTER", "GradientLeases", "Lease", "copy_tensors", "exclusive", "reading"]

TRUST_AFTER = 2
"""Steps in a row in which every gradient of an optimizer was let go cleanly before gradients
are leased instead of copied (one step would trust a loop that zeroes in place every other step)."""


def copy_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` made by one foreach copy (one kernel launch per device and dtype on a
    GPU, instead of one per tensor); asynchronous with respect to the host on a GPU."""
    if not tensors:
        return []
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    torch._foreach_copy_(out, tensors)
    return out


def exclusive(g: torch.Tensor) -> bool:
    """Whether ``g`` may be taken without a copy: a plain dense tensor that owns its whole storage
    (not a view into a bucket or a flat buffer), on the host or a CUDA device, outside autograd."""
    return (type(g) is torch.Tensor and g.layout == torch.strided and g._base is None and not g.requires_grad
            and g.device.type in ("cpu", "cuda") and g.storage_offset() == 0 and g.is_contiguous()
            and g.untyped_storage().nbytes() == g.numel() * g.element_size())


class Lease:
    """The gradients one optimizer step left to a record without a copy; ended once training let
    go of each (or they were copied)."""

    __slots__ = ("_done", "_judge", "_open", "_read", "failure", "ready")

    def __init__(self) -> None:
        self._open = 0
        self._done = threading.Event()
        self._done.set()
        self._read = threading.Lock()  # held by the writer while it reads the gradients
        self._judge: Callable[[], None] | None = None  # looks again at what training let go of
        self.failure: str | None = None  # why the record must not be written
        self.ready: list[Any] = []  # events after copies made on a GPU when the lease ended

    def _take(self) -> None:
        self._open += 1
        self._done.clear()

    def _end(self, failure: str | None = None) -> None:
        if failure is not None and self.failure is None:
            self.failure = failure
        self._open -= 1
        if self._open == 0:
            self._done.set()

    @property
    def ended(self) -> bool:
        return self._done.is_set()

    def wait(self, stop: threading.Event | None = None) -> None:
        """Block (the writer thread) until every gradient is let go or copied; raise
        :class:`GradientMutatedError` if one was changed before. ``stop``: give up when set."""
        while not self._done.wait(0.5):
            if stop is not None and stop.is_set():
                raise DiffCkptError("the writer was stopped while a step's gradients were still in use by training")
        if self.failure is not None:
            raise GradientMutatedError(self.failure)


@contextlib.contextmanager
def reading(leases: list[Lease], judge: bool = False) -> Iterator[None]:
    """Hold ``leases`` for a read of their gradients by the writer, which need not wait for
    training to let go first: training changes no leased gradient in place, nor swaps a copy in
    for it, while this is held (it waits for the read to end instead, which only training that
    is not trusted with leases does). Whether the read holds what the step consumed is known when
    the leases end (:meth:`Lease.wait`). Taken in one order on both sides, so two never deadlock.

    ``judge``: once the read is done, look again at the gradients training let go of while it
    ran, whose check waited for it (the read's references are not training's): training may not
    come back to look before it next waits for the writer (a loop's last step)."""
    with contextlib.ExitStack() as held:
        for lease in sorted(leases, key=id):
            held.enter_context(lease._read)
        yield
    for lease in leases if judge else ():
        if not lease.ended and lease._judge is not None:
            lease._judge()


# One watched gradient: the parameter, the tensor the step consumed, its version counter then,
# and where the record holds it (the list and index to put a copy at), or None when the record
# holds a copy already and the tensor is only watched to learn how training treats it.
_Watched = tuple[torch.Tensor, torch.Tensor, int, "list[Any] | None", int, "Lease | None", int]


class GradientLeases:
    """Takes each optimizer step's gradients for a record, leased or copied, and ends the leases
    at the points where training lets go of the gradients or would change them."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], always_copy: bool = False,
                 skip: frozenset[int] = frozenset()) -> None:
        self.optimizers = optimizers
        self.skip = skip  # ids of parameters whose gradients another rank records (their replicas')
        self.always_copy = always_copy
        self._clean_steps = [0] * len(optimizers)  # steps in a row each optimizer let go cleanly
        self._watched: list[_Watched] = []
        self._step_clean: dict[int, bool] = {}  # optimizer -> all watched let go cleanly, this step
        self._handles: list[Any] = []
        self._zero_grads: list[tuple[torch.optim.Optimizer, Any]] = []
        # Settling runs on the training thread, on autograd's device threads (tensor hooks of a
        # CUDA backward) and, for a flush at exit, on whichever thread flushes.
        self._lock = threading.RLock()
        if always_copy:
            return
        params = {id(p): p for o in optimizers for g in o.param_groups for p in g["params"]}
        for p in params.values():
            if isinstance(p, torch.Tensor) and p.requires_grad and type(p.data) is torch.Tensor:
                self._handles.append(p.register_hook(self._before_accumulate))
        for opt in optimizers:
            self._zero_grads.append((opt, opt.__dict__.get("zero_grad")))
            opt.zero_grad = self._wrap_zero_grad(opt.zero_grad)  # type: ignore[method-assign]

    # ----------------------------------------------------------------- taking
    def leasing(self, index: int) -> bool:
        """Whether optimizer ``index``'s gradients are leased now (trusted to be let go)."""
        return not self.always_copy and self._clean_steps[index] >= TRUST_AFTER

    def take(self, index: int, optimizer: torch.optim.Optimizer,
             local: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[list[torch.Tensor | None]], Lease | None]:
        """The gradients of ``optimizer``'s param groups for a record, and the lease on those
        taken without a copy (``None`` when all were copied). ``local``: a sharded gradient's
        piece on this rank (it is always copied)."""
        leasing = self.leasing(index)
        lease = Lease() if leasing else None
        if lease is not None:
            lease._judge = functools.partial(self.settle, False)
        grads: list[list[torch.Tensor | None]] = []
        to_copy: list[tuple[list[Any], int, torch.Tensor]] = []
        for group in optimizer.param_groups:
            row: list[Any] = []
            for p in group["params"]:
                g = p.grad
                if g is None or id(p) in self.skip:  # skipped, replay leaves the parameter alone
                    row.append(None)
                    continue
                plain = exclusive(g)
                if leasing and plain:
                    assert lease is not None
                    lease._take()
                    row.append(g)
                    self._watched.append((p, g, g._version, row, len(row) - 1, lease, index))
                    continue
                row.append(None)
                to_copy.append((row, len(row) - 1, local(g).detach()))
                if plain and not self.always_copy:  # watched to learn whether training lets go
                    self._watched.append((p, g, g._version, None, 0, None, index))
            grads.append(row)
        for (row, i, _), copy in zip(to_copy, copy_tensors([t for _, _, t in to_copy])):
            row[i] = copy
        self._step_clean.setdefault(index, True)
        if lease is not None and lease.ended:
            lease = None
        return grads, lease

    # ------------------------------------------------------------- settling
    def settle(self, before_change: bool, resolve: bool = False, spare: list[Lease] | None = None) -> None:
        """Look at every watched gradient.

        One that training let go of ends its lease (or counts as let go cleanly). One still held
        by training: with ``before_change`` (training is about to change it in place) its lease
        ends with a copy, and its optimizer is not trusted; with ``resolve`` (training is about
        to wait for the writer) its lease ends with a copy, unless the lease is one of ``spare``
        (a record not handed to the writer yet); otherwise it stays watched.
        """
        if not self._watched:
            return
        with self._lock:
            self._settle(before_change, resolve, {id(lease) for lease in spare or ()})

    def _settle(self, before_change: bool, resolve: bool, spared: set[int]) -> None:
        keep: list[_Watched] = []
        copies: list[tuple[_Watched, torch.Tensor]] = []
        for entry in self._watched:
            p, g, version, row, _, lease, index = entry
            if p.grad is not g:
                if lease is not None and not lease._read.acquire(blocking=resolve):
                    keep.append(entry)  # the writer reads it now, holding references: judged later
                    continue
                # Let go: nothing holds the tensor but this entry (and the record, if leased),
                # the loop variables and getrefcount's argument, and it is unchanged.
                refs = sys.getrefcount(g) - (4 if row is not None else 3)
                changed = g._version != version
                if lease is not None:
                    lease._read.release()
                clean = refs == 0 and not changed
                if not clean:
                    self._step_clean[index] = False
                if lease is not None:
                    if changed:
                        lease._end(f"a gradient of shape {tuple(g.shape)} was changed in place after "
                                   "optimizer.step() and before training let go of it, so the step's record "
                                   "would not hold what the step consumed; if training changes gradients "
                                   "after the step, set CheckpointOptions(copy_gradients=True)")
                    elif refs > 0:
                        copies.append((entry, g))  # something else still holds it: copy
                        continue
                    else:
                        lease._end()
                continue
            if before_change:
                self._step_clean[index] = False
            if (before_change or (resolve and id(lease) not in spared)) and row is not None:
                assert lease is not None
                if g._version != version:  # changed since the step: neither it nor a copy will do
                    self._step_clean[index] = False
                    lease._end(f"a gradient of shape {tuple(g.shape)} was changed in place after "
                               "optimizer.step() while training still held it; if training changes "
                               "gradients after the step, set CheckpointOptions(copy_gradients=True)")
                    continue
                copies.append((entry, g))
            elif before_change:
                continue  # only watched: training keeps its gradients, so it is not trusted
            else:
                keep.append(entry)
        # Not while the writer reads these gradients: the copy would take the read's place, and
        # training may change the original once the lease ended.
        with reading([x for x in {id(e[5]): e[5] for e, _ in copies}.values() if x is not None]):
            made = copy_tensors([g for _, g in copies])
            ready = HostStage.mark(made)  # the writer's device-to-host copies wait for these
            for (entry, _), copy in zip(copies, made):
                _, _, _, row, i, lease, _ = entry
                assert row is not None and lease is not None
                row[i] = copy
                if ready is not None:
                    lease.ready.append(ready)
                lease._end()
        self._watched = keep
        if not keep:
            self._close_step()

    def _close_step(self) -> None:
        """Every gradient of the watched steps is settled: count the optimizers that let go
        cleanly towards trusting them."""
        for index, clean in self._step_clean.items():
            self._clean_steps[index] = self._clean_steps[index] + 1 if clean else 0
        self._step_clean.clear()

    def before_step(self) -> None:
        """The next ``optimizer.step()`` is about to run (it may change gradients in place)."""
        self.settle(before_change=True)

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        # A backward is about to accumulate into .grad: end what training still holds now, all
        # at once (one check for the whole backward: the list is empty after the first).
        if self._watched:
            self.settle(before_change=True)

    def _wrap_zero_grad(self, zero_grad: Callable[..., None]) -> Callable[..., None]:
        # functools.wraps: code that inspects the signature (Accelerate looks for set_to_none)
        # sees the optimizer's own.
        @functools.wraps(zero_grad)
        def wrapped(*args: Any, **kwargs: Any) -> None:
            set_to_none = kwargs.get("set_to_none", args[0] if args else True)
            if not set_to_none and self._watched:
                self.settle(before_change=True)  # zeroes in place: copy first
            zero_grad(*args, **kwargs)
            if set_to_none and self._watched:
                self.settle(before_change=False)
        return wrapped

    def remove(self) -> None:
        """Copy what is still leased and take the hooks and wrappers off."""
        self.settle(before_change=False, resolve=True)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for opt, own in self._zero_grads:
            if own is None:
                opt.__dict__.pop("zero_grad", None)
            else:
                opt.zero_grad = own  # type: ignore[method-assign]
        self._zero_grads.clear()
