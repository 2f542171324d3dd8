"""Training loops on device tensors, with progress bars, epoch timing and resumable checkpoints.

Data stays on the device as tensors; batches are index slices of a seeded
permutation, so there is no DataLoader or per-sample Python work.
Checkpoints are written atomically (temporary file, then ``os.replace``) and
read with ``torch.load(..., weights_only=True)``.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .data import DATA_DIR, Split

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


def checkpoint_path(name: str, profile: str | None = None) -> Path:
    """``data/checkpoints/<profile>/<name>.pt`` (git-ignored; ``<profile>-smoke`` in a smoke run)."""
    from . import profiles

    return DATA_DIR / "checkpoints" / (profile or profiles.storage_name()) / f"{name}.pt"


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write ``state`` atomically: a crash mid-write never leaves a broken checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path, map_location=None) -> dict:
    return torch.load(Path(path), map_location=map_location, weights_only=True)


def scores_of(out) -> torch.Tensor:
    """Class scores ``(B, J)`` from a model output: the tensor itself or its first field."""
    return out if isinstance(out, torch.Tensor) else out[0]


def _autocast(device: torch.device, amp: bool):
    if amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, data: Split, batch_size: int = 500, predict: Callable | None = None,
             amp: bool = False) -> float:
    """Accuracy of ``model`` on ``data``; ``predict(model, x) -> scores (B, J)`` (default ``model(x)``)."""
    if not isinstance(data, Split):
        raise TypeError(f"data must be a capslib.data.Split; got {type(data).__name__}")
    was_training = model.training
    model.eval()
    correct = 0
    dev = data.x.device
    for i in range(0, len(data), batch_size):
        xb, yb = data.x[i:i + batch_size], data.y[i:i + batch_size]
        with _autocast(dev, amp):
            s = predict(model, xb) if predict else scores_of(model(xb))
        correct += int((s.argmax(dim=1) == yb).sum())
    model.train(was_training)
    return correct / max(len(data), 1)


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
    predict: Callable | None = None,
    amp: bool | None = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "train",
    eval_batch_size: int = 500,
    compile: bool | None = None,
    compile_backend: str = "inductor",
) -> dict:
    """Train ``model`` for ``epochs`` epochs; resume from ``checkpoint`` if it exists.

    Args:
        loss_fn: ``loss_fn(model, x, y) -> (loss, scores)``; ``scores (B, J)`` give the
            training accuracy.
        optimizer: default Adam(``lr``); ``lr_decay`` multiplies the rate after each epoch.
        before_step: ``before_step(model, optimizer)`` after ``backward`` and before the
            step (gradient surgery, e.g. chapter 6's sensitivity regulariser).
        on_epoch_end: ``on_epoch_end(epoch, model, history)`` after each epoch; may add
            its own lists to ``history`` (they are saved in the checkpoint).
        amp: bf16 autocast on CUDA (default: on for CUDA).
        eval_batch_size: images per forward pass when ``val`` is scored after each epoch.
        compile: train through ``torch.compile(model, backend=compile_backend)`` (default: when
            ``$CAPSBOOK_COMPILE`` is set, see :func:`capslib.profiles.compile_requested`). Off by
            default: the book's timings are eager. Checkpoints hold the plain model's weights.

    Returns:
        ``history``: lists ``loss``, ``train_acc``, ``val_acc``, ``seconds``,
        ``images_per_s`` (one entry per epoch) and any lists ``on_epoch_end`` added.
    """
    if not isinstance(train, Split):
        raise TypeError(f"train must be a capslib.data.Split; got {type(train).__name__}")
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an int >= 0; got {epochs!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}")
    device = train.x.device
    amp = device.type == "cuda" if amp is None else amp
    from . import profiles
    step_model = model
    if profiles.compile_requested() if compile is None else compile:
        step_model = torch.compile(model, backend=compile_backend)
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, lr_decay) if lr_decay else None
    history: dict = {"loss": [], "train_acc": [], "val_acc": [], "seconds": [], "images_per_s": []}
    start = 0
    if checkpoint is not None and Path(checkpoint).exists():
        state = load_checkpoint(checkpoint, map_location=device)
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if scheduler is not None and "scheduler" in state:
                scheduler.load_state_dict(state["scheduler"])
            history = state["history"]
            start = int(state["epoch"])
            if "rng" in state:
                torch.set_rng_state(state["rng"].cpu())
        except (RuntimeError, KeyError, ValueError) as err:
            print(f"checkpoint {checkpoint} does not fit this model ({type(err).__name__}); training from scratch")
            start = 0
        else:
            if start >= epochs:
                print(f"loaded {checkpoint}: {start} epochs already trained")
            else:
                print(f"resuming {checkpoint} at epoch {start + 1}/{epochs}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(start):  # keep the permutation sequence identical on resume
        torch.randperm(len(train), generator=gen)
    n = len(train)
    steps = math.ceil(n / batch_size)
    for epoch in range(start, epochs):
        model.train()
        perm = torch.randperm(n, generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        # running sums stay on the device: no host sync per step
        total = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        seen = 0
        bar = tqdm(range(steps), desc=f"{desc} {epoch + 1}/{epochs}", leave=False,
                   disable=not progress or tqdm is None, mininterval=1.0)
        for s in bar:
            idx = perm[s * batch_size:(s + 1) * batch_size]
            xb, yb = train.x[idx], train.y[idx]
            with _autocast(device, amp):
                loss, scores = loss_fn(step_model, xb, yb)
            loss_d = loss.detach()
            nonfinite += (~torch.isfinite(loss_d)).long()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if before_step is not None:
                before_step(model, optimizer)
            optimizer.step()
            total += loss_d.double() * len(idx)
            correct += (scores.detach().argmax(dim=1) == yb).sum()
            seen += len(idx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        total, correct = float(total), int(correct)
        if int(nonfinite):
            history["nonfinite_steps"] = history.get("nonfinite_steps", 0) + int(nonfinite)
        if scheduler is not None:
            scheduler.step()
        history["loss"].append(total / seen)
        history["train_acc"].append(correct / seen)
        history["val_acc"].append(evaluate(model, val, batch_size=eval_batch_size, predict=predict, amp=amp) if val is not None else float("nan"))
        history["seconds"].append(secs)
        history["images_per_s"].append(seen / secs)
        if on_epoch_end is not None:
            on_epoch_end(epoch, model, history)
        if progress:
            va = history["val_acc"][-1]
            print(f"{desc} epoch {epoch + 1}/{epochs}: loss {history['loss'][-1]:.4f}  "
                  f"train acc {history['train_acc'][-1]:.3f}" + ("" if math.isnan(va) else f"  val acc {va:.3f}")
                  + f"  {secs:.1f} s ({seen / secs:.0f} img/s)")
        if checkpoint is not None:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                     "history": history, "rng": torch.get_rng_state()}
            if scheduler is not None:
                state["scheduler"] = scheduler.state_dict()
            save_checkpoint(checkpoint, state)
    return history


def seconds_per_epoch(history: dict) -> float:
    """Median epoch time (the first epoch pays one-off warm-up costs)."""
    s = sorted(history["seconds"])
    if not s:
        return float("nan")
    return s[len(s) // 2]
