"""One training step, and three ways for :func:`capslib.train.fit` to run many of them.

:func:`train_step` is the step every path runs: the loss, the backward pass, the epoch's running sums
(kept on the device, so no step waits for the host) and the optimizer's step. ``fit`` runs it

* **eager** (the default, ``fast`` off): one step per batch of a seeded permutation, the last batch
  of an epoch smaller when the training set is not a multiple of the batch size. Every ``ci`` number
  of the book is made this way.
* **static** (``fast="static"``, or ``fast=True`` where no CUDA graph can be had): every step takes
  exactly ``batch_size`` images, so the permutation's last partial batch is dropped (each epoch
  then sees ``(n // batch_size) * batch_size`` images; ``history["images_seen"]`` records it), and
  when ``fit`` makes the optimizer it is Adam with ``fused=True`` (one kernel updates every
  parameter) where this torch has it for the device.
* **graphed** (``fast=True`` or ``"graph"`` on CUDA): the static step, captured once into a CUDA graph
  (forward, loss, backward, the running sums and the optimizer's step) over static input buffers and
  replayed for every batch: the batch is copied into the buffers, then one launch does the whole step.
  :class:`GraphedSteps` follows the recipe of PyTorch's CUDA-graph notes: a few eager warm-up steps
  on a side stream (they are real training steps, on real batches), ``zero_grad(set_to_none=True)``
  before the capture, Adam made with ``capturable=True`` and a learning rate held in a device tensor,
  so that ``lr_decay`` (``ExponentialLR``, which writes that tensor in place) reaches the captured step.
  Augmentation runs outside the graph, before the copy. Autocast inside the graph runs with its cast
  cache off (the cache does not survive a replay).

The graphed path falls back, and says why in ``history["step_path_reason"]``: to the eager step when
``fit`` has a ``before_step`` hook (gradient surgery between backward and step) or runs data-parallel
under ``torchrun`` (gradients summed between backward and step); to the static path on a CPU, under
``torch.compile``, with an optimizer that cannot be captured, or when the capture itself raises (one
printed line). ``history["step_path"]`` names the path that ran: ``"eager"``, ``"static"`` or
``"graphed"``.

Without a GPU the capture logic still runs: :class:`EagerGraphs` stands in for the CUDA calls (its
"capture" keeps the step, its "replay" runs it eagerly), so the buffers, the warm-up, the replay loop,
the learning-rate tensor and the fallback are tested on a CPU (``tests/test_steps.py``).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

FAST_ENV = "CAPSBOOK_FAST"   # fit(fast=None) reads it: 1/graph, static, or 0/empty (off, the default)
STEP_PATHS = ("eager", "static", "graphed")
WARMUP_STEPS = 3             # eager steps before the capture (PyTorch's notes: a few; cuDNN autotuning)


def autocast(device: torch.device, amp: bool, cache: bool = True):
    """bf16 autocast on CUDA when ``amp`` (``cache=False`` inside a CUDA graph); nothing otherwise."""
    if amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=None if cache else False)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- the step

class StepSums:
    """An epoch's running sums on the device: loss times images, correct predictions, non-finite losses."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)

    def add(self, loss: torch.Tensor, scores: torch.Tensor, y: torch.Tensor) -> None:
        self.nonfinite += (~torch.isfinite(loss)).long()
        self.total += loss.double() * len(y)
        self.correct += (scores.detach().argmax(dim=1) == y).sum()

    def zero_(self) -> None:
        """Start an epoch: in place, so that a captured step keeps adding into the same memory."""
        for t in (self.total, self.correct, self.nonfinite):
            t.zero_()


def train_step(model, loss_fn: Callable, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               sums: StepSums, *, amp_context: Callable = contextlib.nullcontext, share: float | None = None,
               reduce_gradients: Callable | None = None, before_step: Callable | None = None,
               plain_model=None) -> torch.Tensor:
    """One training step on the batch ``(x, y)``; returns the batch's loss (detached).

    ``loss_fn(model, x, y) -> (loss, scores)``; ``amp_context()`` opens the forward pass's autocast
    context. Data-parallel (:mod:`capslib.engine.distributed`): ``share`` weighs this rank's batch mean by its
    part of the global batch (0: the rank runs a stand-in image that counts nowhere) and
    ``reduce_gradients()`` sums the gradients over ranks. ``before_step(plain_model, optimizer)``
    runs between backward and the optimizer's step.
    """
    with amp_context():
        loss, scores = loss_fn(model, x, y)
    loss_d = loss.detach()
    optimizer.zero_grad(set_to_none=True)
    (loss * share if share is not None else loss).backward()
    if share is None or share > 0:
        sums.add(loss_d, scores, y)
    if reduce_gradients is not None:
        reduce_gradients()
    if before_step is not None:
        before_step(plain_model, optimizer)
    optimizer.step()
    return loss_d


def static_steps(n: int, batch_size: int) -> int:
    """Steps per epoch with static shapes: whole batches only (one batch of all ``n`` when ``n < batch_size``)."""
    return n // batch_size if n >= batch_size else 1


# ----------------------------------------------------------------------------- the switch

def requested(fast) -> str | None:
    """``fit``'s ``fast`` as a mode: None (off), ``"static"`` or ``"graph"``. ``None`` reads
    ``$CAPSBOOK_FAST`` (unset: off); ``True`` means ``"graph"``, ``False`` off."""
    if fast is None:
        fast = os.environ.get(FAST_ENV, "").strip() or False
    if isinstance(fast, str):
        fast = fast.strip().lower()
    if fast is False or fast in ("0", "off", "no", "false"):
        return None
    if fast is True or fast in ("1", "on", "yes", "true", "graph", "graphed"):
        return "graph"
    if fast == "static":
        return "static"
    raise ValueError(f"fast must be None, True, False, 'static' or 'graph' (${FAST_ENV} likewise); got {fast!r}")


@dataclass
class Plan:
    """What ``fit`` will run: the ``mode`` asked for, the ``path`` chosen, why it differs, the graph calls."""
    mode: str | None
    path: str = "eager"
    reason: str | None = None
    backend: object = None
    notes: list = field(default_factory=list)

    @property
    def static(self) -> bool:
        """Whether batches have static shapes (the static and graphed paths)."""
        return self.path in ("static", "graphed")

    def without_capture(self, reason: str) -> None:
        self.path, self.reason, self.backend = "static", reason, None


def graph_backend(device: torch.device):
    """The CUDA graph calls for ``device`` (:class:`CudaGraphs`), or None on a device without them."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaGraphs(device)
    return None


def plan(fast, device: torch.device, *, distributed: bool = False, before_step: bool = False,
         compiled: bool = False) -> Plan:
    """Choose the path for ``fast`` (see the module's docstring for the fallbacks)."""
    mode = requested(fast)
    if mode is None:
        return Plan(None)
    if distributed:
        return Plan(mode, "eager", "data-parallel under torchrun: gradients are summed between backward and step")
    if before_step:
        return Plan(mode, "eager", "a before_step hook changes gradients between backward and step")
    if mode == "static":
        return Plan(mode, "static")
    if compiled:
        return Plan(mode, "static", "torch.compile: the compiled step is not captured")
    backend = graph_backend(device)
    if backend is None:
        return Plan(mode, "static", f"CUDA graphs need a CUDA device; this run is on {torch.device(device).type}")
    return Plan(mode, "graphed", backend=backend)


def adam(params, lr: float, device: torch.device, plan: Plan) -> torch.optim.Optimizer:
    """The Adam that ``fit`` makes on the fast path: ``fused=True`` where this torch has it for
    ``device``; for a captured step also ``capturable=True`` (CUDA) and the learning rate in a tensor on
    ``device``, which the captured step reads at every replay. Falls back to the plain Adam (noted)."""
    params = list(params)
    device = torch.device(device)
    capture = plan.path == "graphed"
    cuda = device.type == "cuda"
    rate = torch.tensor(float(lr), device=device) if capture else lr
    try:
        return torch.optim.Adam(params, lr=rate, fused=True, capturable=capture and cuda)
    except (RuntimeError, ValueError, TypeError) as err:   # no fused kernel for this device or torch
        plan.notes.append(f"fused Adam unavailable ({str(err).splitlines()[0][:120]}); plain Adam")
        return torch.optim.Adam(params, lr=rate if capture and cuda else lr, capturable=capture and cuda)


def check_capturable(plan: Plan, optimizer: torch.optim.Optimizer, scheduled: bool) -> None:
    """Drop the capture where the optimizer could not be replayed correctly: made with
    ``capturable=False`` on CUDA, or a learning rate held as a Python number that ``lr_decay`` changes
    (a captured step would keep the first value)."""
    if plan.path != "graphed":
        return
    groups = optimizer.param_groups
    if isinstance(plan.backend, CudaGraphs) and any(g.get("capturable") is False for g in groups):
        plan.without_capture("the optimizer was made with capturable=False")
    elif scheduled and not all(isinstance(g["lr"], torch.Tensor) for g in groups):
        plan.without_capture("lr_decay changes a learning rate held as a number: a captured step would keep it")


# ----------------------------------------------------------------------------- running the steps

class EagerSteps:
    """Runs the step on each batch as it comes (the eager and static paths)."""

    def __init__(self, step: Callable, path: str = "static"):
        self.step, self.path, self.reason = step, path, None
        self.last_loss: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.last_loss = self.step(x, y)

    def after_lr_change(self) -> None:
        pass


class Captured:
    """A captured step: ``replay()`` runs it again; ``output`` is the tensor it returns (refilled by each replay)."""

    def __init__(self, replay: Callable | None = None, output=None):
        self.replay, self.output = replay, output


class CudaGraphs:
    """The CUDA calls :class:`GraphedSteps` makes: warm-up on a side stream, capture, replay."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(device=self.device)

    @contextlib.contextmanager
    def side_stream(self):
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)

    def capture(self, fn: Callable) -> Captured:
        graph = torch.cuda.CUDAGraph()
        # captured on the warm-up's stream, so that the library handles it created there are reused
        with torch.cuda.graph(graph, stream=self._stream):
            out = fn()
        return Captured(graph.replay, out)


class EagerGraphs:
    """A stand-in for :class:`CudaGraphs` on a CPU: ``capture`` keeps the step without running it (as
    a CUDA capture records kernels without executing them) and each replay runs it eagerly on the
    buffers it was given. Counts captures and replays."""

    def __init__(self, fail: BaseException | None = None):
        self.fail, self.captures, self.replays = fail, 0, 0

    def side_stream(self):
        return contextlib.nullcontext()

    def capture(self, fn: Callable) -> Captured:
        if self.fail is not None:
            raise self.fail
        self.captures += 1
        captured = Captured()

        def replay():
            captured.output = fn()
            self.replays += 1
        captured.replay = replay
        return captured


class GraphedSteps:
    """Runs the step through a captured graph: static buffers, ``warmup`` eager steps, one capture,
    then for every batch a copy into the buffers and a replay. A capture that raises leaves the
    static eager step in charge (one printed line; ``path`` becomes ``"static"``, ``reason`` says why).

    ``step(x, y) -> loss`` must be :func:`train_step` bound to its model, loss, optimizer and sums;
    ``optimizer`` is the one it steps (its gradients are dropped before the capture, its learning-rate
    tensors kept in place by :meth:`after_lr_change`)."""

    def __init__(self, step: Callable, backend, optimizer: torch.optim.Optimizer, warmup: int = WARMUP_STEPS,
                 log: Callable = print):
        self.step, self.backend, self.optimizer, self.warmup, self.log = step, backend, optimizer, warmup, log
        self.path, self.reason = "graphed", None
        self.x: torch.Tensor | None = None      # the static input buffers
        self.y: torch.Tensor | None = None
        self.graph: Captured | None = None
        self.warmed = 0
        self.last_loss: torch.Tensor | None = None
        self._lrs: list = []

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.path != "graphed":
            self.last_loss = self.step(x, y)
            return
        if self.x is None:
            self.x, self.y = torch.empty_like(x), torch.empty_like(y)
        elif x.shape != self.x.shape or y.shape != self.y.shape:
            raise ValueError(f"a captured step needs the same batch shape every time: captured "
                             f"{tuple(self.x.shape)}, given {tuple(x.shape)}")
        self.x.copy_(x)
        self.y.copy_(y)
        if self.graph is None:
            if self.warmed < self.warmup:
                with self.backend.side_stream():
                    self.last_loss = self.step(self.x, self.y)
                self.warmed += 1
                return
            try:
                self.optimizer.zero_grad(set_to_none=True)
                self._lrs = [g["lr"] for g in self.optimizer.param_groups]
                self.graph = self.backend.capture(lambda: self.step(self.x, self.y))
            except Exception as err:  # noqa: BLE001 - any failed capture leaves the eager step in charge
                self._fall_back(err)
                self.last_loss = self.step(x, y)
                return
        self.graph.replay()
        self.last_loss = self.graph.output

    def _fall_back(self, err: BaseException) -> None:
        self.graph = None
        self.optimizer.zero_grad(set_to_none=True)   # drop gradients the failed capture allocated
        first = (str(err).strip().splitlines() or [""])[0][:160]
        self.path, self.reason = "static", f"CUDA graph capture failed: {type(err).__name__}: {first}"
        self.log(f"{self.reason}; training on with the static eager step")

    def after_lr_change(self) -> None:
        """After a scheduler step: the captured step reads the learning-rate tensors it was captured
        with, so a group whose rate was replaced gets its value written back into that tensor."""
        if self.graph is None:
            return
        for group, held in zip(self.optimizer.param_groups, self._lrs):
            if group["lr"] is not held and isinstance(held, torch.Tensor):
                with torch.no_grad():
                    held.fill_(float(group["lr"]))
                group["lr"] = held
