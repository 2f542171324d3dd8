"""Training loops on device tensors, with progress bars, epoch timing and resumable checkpoints.

Data stays on the device as tensors; batches are index slices of a seeded
permutation, so there is no DataLoader or per-sample Python work. Each step is
:func:`capslib.engine.steps.train_step`; ``fit(..., fast=...)`` runs it with static batch shapes, fused Adam
and, on CUDA, captured in a CUDA graph (:mod:`capslib.engine.steps`). Checkpoints
(:mod:`capslib.engine.checkpoints`) carry the fingerprint of the run that wrote them: a run resumes only a
checkpoint of its own configuration. Data-parallel training under ``torchrun`` is
:mod:`capslib.engine.distributed`.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from .engine import steps as _steps
from .engine.checkpoints import (  # noqa: F401  (re-exported: callers use capslib.train.<name>)
    fingerprint_difference, load_checkpoint, resumable, run_fingerprint, save_checkpoint,
)
from .data import DATA_DIR, Split
from .engine.distributed import (  # noqa: F401  (re-exported)
    broadcast_parameters, distributed_ranks, init_distributed, sum_gradients, sum_over_ranks,
)

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


def checkpoint_path(name: str, profile: str | None = None) -> Path:
    """``data/checkpoints/<profile>/<name>.pt`` (git-ignored; ``<profile>-smoke`` in a smoke run).
    ``$CAPSBOOK_CHECKPOINTS`` replaces ``data/checkpoints``: ``make publish`` points it at an empty
    folder so that every training of the published outputs starts from scratch."""
    from .engine import switches

    root = os.environ.get("CAPSBOOK_CHECKPOINTS", "").strip()
    return (Path(root) if root else DATA_DIR / "checkpoints") / (profile or switches.storage_name()) / f"{name}.pt"



class TimeLimitReached(RuntimeError):
    """Raised by :func:`fit` at an epoch boundary, after its checkpoint is written, once the session
    has run for ``$CAPSBOOK_TIME_LIMIT`` seconds: the same call resumes from that checkpoint."""


def time_limit() -> float | None:
    """``$CAPSBOOK_TIME_LIMIT`` in seconds (counted from ``capslib.book.setup()``), or None when unset."""
    raw = os.environ.get("CAPSBOOK_TIME_LIMIT", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"CAPSBOOK_TIME_LIMIT must be a number of seconds; got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"CAPSBOOK_TIME_LIMIT must be positive; got {raw!r}")
    return value


def scores_of(out) -> torch.Tensor:
    """Class scores ``(B, J)`` from a model output: the tensor itself or its first field."""
    return out if isinstance(out, torch.Tensor) else out[0]


def _autocast(device: torch.device, amp: bool):
    return _steps.autocast(device, amp)



@torch.no_grad()
def evaluate(model: nn.Module, data: Split, batch_size: int = 500, predict: Callable | None = None,
             amp: bool = False) -> float:
    """Accuracy of ``model`` on ``data``; ``predict(model, x) -> scores (B, J)`` (default ``model(x)``)."""
    return int(correct(model, data, batch_size, predict, amp).sum()) / max(len(data), 1)


@torch.no_grad()
def correct(model: nn.Module, data: Split, batch_size: int = 500, predict: Callable | None = None,
            amp: bool = False) -> torch.Tensor:
    """Which examples of ``data`` ``model`` classifies right, ``(N,)`` bool (for differences paired over the
    examples); the arguments as in :func:`evaluate`. The model is evaluated in eval mode and left in its mode."""
    if not isinstance(data, Split):
        raise TypeError(f"data must be a capslib.data.Split; got {type(data).__name__}")
    was_training = model.training
    model.eval()
    dev = data.x.device
    right = []
    try:
        for i in range(0, len(data), batch_size):
            xb, yb = data.x[i:i + batch_size], data.y[i:i + batch_size]
            with _autocast(dev, amp):
                s = predict(model, xb) if predict else scores_of(model(xb))
            right.append(s.argmax(dim=1) == yb)
    finally:
        model.train(was_training)
    return torch.cat(right) if right else torch.zeros(0, dtype=torch.bool, device=dev)


def fit(
    model: nn.Module,
    train: Split,
    loss_fn: Callable,
    *,
    epochs: int,
    batch_size: int,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float = 1e-3,
    lr_decay: float | None = None,
    val: Split | None = None,
    checkpoint: str | Path | None = None,
    before_step: Callable | None = None,
    on_epoch_end: Callable | None = None,
    stop_when: Callable | None = None,
    predict: Callable | None = None,
    amp: bool | None = None,
    seed: int | None = None,
    config: dict | None = None,
    start_from: str | Path | Sequence[str | Path] | None = None,
    progress: bool = True,
    desc: str = "train",
    eval_batch_size: int = 500,
    compile: bool | None = None,
    compile_backend: str = "inductor",
    augment: Callable | None = None,
    fast: bool | str | None = None,
) -> dict:
    """Train ``model`` for ``epochs`` epochs; resume from ``checkpoint`` if it exists.

    Args:
        loss_fn: ``loss_fn(model, x, y) -> (loss, scores)``; ``scores (B, J)`` give the
            training accuracy.
        optimizer: default Adam(``lr``); ``lr_decay`` multiplies the rate after each epoch.
        before_step: ``before_step(model, optimizer)`` after ``backward`` and before the
            step (gradient surgery, e.g. chapter 6's sensitivity regulariser).
        on_epoch_end: ``on_epoch_end(epoch, model, history)`` after each epoch; may add
            its own lists to ``history`` (they are saved in the checkpoint). It may change weights
            in place, never replace the model's tensors (a captured step keeps using them).
        stop_when: ``stop_when(history) -> bool``, asked after each epoch (once its checkpoint is
            written) and after a resume: True ends the run before ``epochs`` (e.g. a baseline trained
            until its validation accuracy reaches a target). A resumed history that already satisfies
            it returns at once; one that does not trains on.
        amp: bf16 autocast on CUDA (default: on for CUDA).
        eval_batch_size: images per forward pass when ``val`` is scored after each epoch.
        compile: train through ``torch.compile(model, backend=compile_backend)`` (default: when
            ``$CAPSBOOK_COMPILE`` is set, see :func:`capslib.engine.switches.compile_requested`). Off by
            default: the book's timings are eager. Checkpoints hold the plain model's weights.
        augment: ``augment(x) -> x`` applied to every training batch before the forward pass (e.g.
            :class:`capslib.data.RandomShift`, the paper's shifts); it joins the fingerprint.
        seed: seeds the minibatch permutations (default: the run's seed, :func:`capslib.engine.switches.default_seed`).
        fast: the fast training step (:mod:`capslib.engine.steps`). Off by default (``None`` reads
            ``$CAPSBOOK_FAST``, unset: off), so every ``ci`` number is made by the eager step.
            ``"static"``: every step ``batch_size`` images (the permutation's last partial batch is
            dropped; ``history["images_seen"]`` counts each epoch's images) and, when ``fit`` makes the
            optimizer, fused Adam. ``True`` (or ``"graph"``): that, and on CUDA the whole step captured
            in a CUDA graph and replayed per batch. With ``before_step`` or under ``torchrun`` the eager
            step runs instead; ``history["step_path"]`` says which path ran (``"eager"``, ``"static"``,
            ``"graphed"``) and ``history["step_path_reason"]`` why it is not the one asked for.
        Time limit: with ``$CAPSBOOK_TIME_LIMIT`` set and a ``checkpoint``, a run that has used up
            that many seconds since ``capslib.book.setup()`` raises :class:`TimeLimitReached` after
            writing the checkpoint of the epoch it just finished; calling it again resumes there.
        checkpoint: written atomically after every epoch with the run's fingerprint
            (:func:`run_fingerprint`). An existing file is resumed only when its fingerprint
            equals this run's and it holds at most ``epochs`` epochs; otherwise one line says
            why, the file is renamed ``<name>.stale-<time>.pt`` (kept) and training starts over.
        config: anything else that decides the run and that ``fit`` cannot see (e.g. a
            loss weight held in a global); it joins the fingerprint.
        start_from: checkpoint(s) of a shorter run of this same configuration to continue when
            ``checkpoint`` does not exist yet (e.g. a shared pre-training phase); the one with the
            most epochs among those whose fingerprint matches is used.

    Returns:
        ``history``: lists ``loss``, ``train_acc``, ``val_acc``, ``seconds``,
        ``images_per_s`` (one entry per epoch) and any lists ``on_epoch_end`` added; with ``fast``
        asked for, also ``images_seen`` (per epoch), ``step_path`` and, where they apply,
        ``step_path_reason`` and ``step_notes`` (e.g. no fused Adam for this device).
    """
    if not isinstance(train, Split):
        raise TypeError(f"train must be a capslib.data.Split; got {type(train).__name__}")
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an int >= 0; got {epochs!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}")
    device = train.x.device
    amp = device.type == "cuda" if amp is None else amp
    from .engine import switches
    step_model = model
    compiled = switches.compile_requested() if compile is None else compile
    if compiled:
        step_model = torch.compile(model, backend=compile_backend)
    ranks = distributed_ranks()
    plan = _steps.plan(fast, device, distributed=ranks is not None, before_step=before_step is not None,
                       compiled=bool(compiled))
    if optimizer is None:
        optimizer = _steps.adam(model.parameters(), lr, device, plan) if plan.static else \
            torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, lr_decay) if lr_decay else None
    _steps.check_capturable(plan, optimizer, scheduled=scheduler is not None)
    if seed is None:
        seed = switches.default_seed()
    history: dict = {"loss": [], "train_acc": [], "val_acc": [], "seconds": [], "images_per_s": []}
    start = 0
    fingerprint = None
    if checkpoint is not None:
        fingerprint = run_fingerprint(model, train, optimizer, loss_fn=loss_fn, batch_size=batch_size,
                                      lr_decay=lr_decay, seed=seed, amp=amp, before_step=before_step,
                                      on_epoch_end=on_epoch_end, config=config, augment=augment,
                                      static_batches=plan.static)
        state, source = resumable(Path(checkpoint), start_from, fingerprint, epochs, device)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if scheduler is not None and "scheduler" in state:
                scheduler.load_state_dict(state["scheduler"])
            history = state["history"]
            start = int(state["epoch"])
            if "rng" in state:
                torch.set_rng_state(state["rng"].cpu())
            if source != Path(checkpoint):  # a shared start (``start_from``), made earlier in this run
                if progress:               # (nothing of the caller's is resumed: quiet when progress is off)
                    print(f"starting from {source.name} ({start} epoch{'s' * (start != 1)} trained), "
                          f"training epochs {start + 1}-{epochs}")
            elif start >= epochs:
                print(f"loaded {source.name}: {start} epochs already trained")
            elif stop_when is not None and stop_when(history):
                return history
            else:
                print(f"resuming {source.name} at epoch {start + 1}/{epochs} (epochs 1-{start} trained earlier)")
    # a time limit stops only runs that keep a checkpoint (nothing trained is lost)
    limit = time_limit() if checkpoint is not None else None
    if limit is not None:
        started = switches.run_started()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(start):  # keep the permutation sequence identical on resume
        torch.randperm(len(train), generator=gen)
    n = len(train)
    steps = _steps.static_steps(n, batch_size) if plan.static else math.ceil(n / batch_size)
    if ranks is not None:
        broadcast_parameters(model)
        # each rank its own random stream for what a step draws (dropout masks), not the same masks W times
        torch.manual_seed(seed * 1009 + ranks[0])
        limit = None   # a time limit would stop one rank between collectives: not under torchrun
    eager_context = lambda: _autocast(device, amp)  # noqa: E731
    reduce = (lambda: sum_gradients(model)) if ranks is not None else None  # noqa: E731
    runner = None
    if plan.static:   # the fast path: one step function, run as it is or through a captured graph
        fast_sums = _steps.StepSums(device)   # the same tensors every epoch (a captured step adds into them)
        context = lambda: _steps.autocast(device, amp, cache=plan.path != "graphed")  # noqa: E731

        def step(xb, yb):
            return _steps.train_step(step_model, loss_fn, optimizer, xb, yb, fast_sums, amp_context=context)
        runner = _steps.GraphedSteps(step, plan.backend, optimizer) if plan.path == "graphed" else \
            _steps.EagerSteps(step, plan.path)
    if plan.mode is not None:
        history.setdefault("images_seen", [])
    for epoch in range(start, epochs):
        model.train()
        perm = torch.randperm(n, generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        # running sums stay on the device: no host sync per step
        if runner is not None:
            sums = fast_sums
            sums.zero_()
        else:
            sums = _steps.StepSums(device)
        seen = 0
        bar = tqdm(range(steps), desc=f"{desc} {epoch + 1}/{epochs}", leave=False,
                   disable=not progress or tqdm is None or not switches.progress_bars(), mininterval=1.0)
        for s in bar:
            idx = perm[s * batch_size:(s + 1) * batch_size]
            xb, yb = train.x[idx], train.y[idx]
            if augment is not None:
                xb = augment(xb)
            if runner is not None:
                runner(xb, yb)
                seen += len(yb)
                continue
            share = None
            if ranks is not None:   # data parallel: this rank's shard of the global batch
                shard = slice(ranks[0], None, ranks[1])
                share = len(yb[shard]) / len(yb)   # a rank's batch mean weighs its share of the global mean
                # a last batch smaller than the number of ranks leaves some rank nothing: it runs one image
                # at weight 0, so that every rank's gradients have the same structure for the sum
                xb, yb = (xb[shard], yb[shard]) if share > 0 else (xb[:1], yb[:1])
            _steps.train_step(step_model, loss_fn, optimizer, xb, yb, sums, amp_context=eager_context, share=share,
                              reduce_gradients=reduce, before_step=before_step, plain_model=model)
            seen += len(yb) if share is None or share > 0 else 0
        total, correct, nonfinite = sums.total, sums.correct, sums.nonfinite
        if ranks is not None:
            total, correct, nonfinite, seen = sum_over_ranks(total, correct, nonfinite, seen)
        if device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        total, correct = float(total), int(correct)
        if int(nonfinite):
            history["nonfinite_steps"] = history.get("nonfinite_steps", 0) + int(nonfinite)
        if scheduler is not None:
            scheduler.step()
            if runner is not None:
                runner.after_lr_change()
        history["loss"].append(total / seen)
        history["train_acc"].append(correct / seen)
        history["val_acc"].append(evaluate(model, val, batch_size=eval_batch_size, predict=predict, amp=amp) if val is not None else float("nan"))
        history["seconds"].append(secs)
        history["images_per_s"].append(seen / secs)
        if plan.mode is not None:
            history["images_seen"].append(seen)
            history["step_path"] = runner.path if runner is not None else "eager"
            reason = (runner.reason if runner is not None else None) or plan.reason
            if reason:
                history["step_path_reason"] = reason
            if plan.notes:   # e.g. no fused Adam for this device
                history["step_notes"] = list(plan.notes)
        if on_epoch_end is not None:
            on_epoch_end(epoch, model, history)
        if progress and (ranks is None or ranks[0] == 0):
            va = history["val_acc"][-1]
            print(f"{desc} epoch {epoch + 1}/{epochs}: loss {history['loss'][-1]:.4f}  "
                  f"train acc {history['train_acc'][-1]:.3f}" + ("" if math.isnan(va) else f"  val acc {va:.3f}")
                  + f"  {secs:.1f} s ({seen / secs:.0f} img/s)")
        if checkpoint is not None and (ranks is None or ranks[0] == 0):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                     "history": history, "rng": torch.get_rng_state(), "fingerprint": fingerprint}
            if scheduler is not None:
                state["scheduler"] = scheduler.state_dict()
            save_checkpoint(checkpoint, state)
            if limit is not None and epoch + 1 < epochs and time.time() - started >= limit:
                raise TimeLimitReached(
                    f"{desc}: stopped after epoch {epoch + 1}/{epochs}, CAPSBOOK_TIME_LIMIT={limit:g} s reached; "
                    f"checkpoint {Path(checkpoint).name} written: run again to resume")
        if stop_when is not None and stop_when(history):
            break
    return history


def seconds_per_epoch(history: dict) -> float:
    """Median epoch time (the first epoch pays one-off warm-up costs)."""
    s = sorted(history["seconds"])
    if not s:
        return float("nan")
    return s[len(s) // 2]
