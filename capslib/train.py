"""Training loops on device tensors, with progress bars, epoch timing and resumable checkpoints.

Data stays on the device as tensors; batches are index slices of a seeded
permutation, so there is no DataLoader or per-sample Python work.
Checkpoints are written atomically (temporary file, then ``os.replace``) and
read with ``torch.load(..., weights_only=True)``. Each one carries the fingerprint of the
run that wrote it (:func:`run_fingerprint`): a run resumes only a checkpoint of its own
configuration; any other is moved aside (kept, never overwritten) and the run starts over.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from .data import DATA_DIR, Split

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


def checkpoint_path(name: str, profile: str | None = None) -> Path:
    """``data/checkpoints/<profile>/<name>.pt`` (git-ignored; ``<profile>-smoke`` in a smoke run).
    ``$CAPSBOOK_CHECKPOINTS`` replaces ``data/checkpoints``: ``make publish`` points it at an empty
    folder so that every training of the published outputs starts from scratch."""
    from . import switches

    root = os.environ.get("CAPSBOOK_CHECKPOINTS", "").strip()
    return (Path(root) if root else DATA_DIR / "checkpoints") / (profile or switches.storage_name()) / f"{name}.pt"


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write ``state`` atomically: a crash mid-write never leaves a broken checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path, map_location=None) -> dict:
    return torch.load(Path(path), map_location=map_location, weights_only=True)


# ----------------------------------------------------------------------------- run fingerprints

# capslib modules whose code decides what any training computes
_CORE_MODULES = ("capslib.ops", "capslib.routing", "capslib.layers", "capslib.train")


def _sha(*chunks: bytes) -> str:
    h = hashlib.sha1()
    for c in chunks:
        h.update(c)
    return h.hexdigest()[:12]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return str((tuple(t.shape), str(t.dtype))).encode() + t.view(-1).view(torch.uint8).numpy().tobytes()


def _state_digest(model: nn.Module) -> str:
    """Digest of the model's state (parameter and buffer names, shapes and values)."""
    parts = []
    for k, v in model.state_dict().items():
        parts.append(k.encode())
        parts.append(_tensor_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode())
    return _sha(*parts)


def _data_digest(split: Split, sample: int = 1024) -> dict:
    """Size, shape and a digest of ``sample`` evenly strided images and every label."""
    n = len(split)
    stride = max(1, n // sample)
    return {"n": n, "shape": list(split.x.shape[1:]),
            "digest": _sha(_tensor_bytes(split.x[::stride]), _tensor_bytes(split.y))}


def _plain_value(v):
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, float):
        return float(f"{v:.10g}")
    if isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return [_plain_value(x) for x in v]
    return None


def _describe_callable(f) -> str | None:
    """A callable by name, with the simple numbers and strings it carries (closure cells,
    attributes of the object it belongs to): a changed margin or lambda changes the key."""
    if f is None:
        return None
    owner = getattr(f, "__self__", None)
    if owner is not None:  # a bound method: its object's settings
        return f"{type(owner).__qualname__}.{f.__name__}" + _describe_attrs(owner)
    if inspect.isfunction(f):
        cells = {}
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            try:
                v = _plain_value(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
            if v is not None:
                cells[name] = v
        return f.__qualname__ + (json.dumps(cells, sort_keys=True) if cells else "")
    return type(f).__qualname__ + _describe_attrs(f)


def _describe_attrs(obj) -> str:
    attrs = {k: _plain_value(v) for k, v in sorted(vars(obj).items()) if not k.startswith("_")} \
        if hasattr(obj, "__dict__") else {}
    attrs = {k: v for k, v in attrs.items() if v is not None}
    return json.dumps(attrs, sort_keys=True) if attrs else ""


def _module_of(obj) -> str | None:
    mod = getattr(getattr(obj, "__func__", obj), "__module__", None) or type(obj).__module__
    return mod if mod and mod.startswith("capslib") else None


def _code_digest(objects) -> str:
    """Digest of the source of the capslib modules that define ``objects`` and of the core ones."""
    names = set(_CORE_MODULES)
    for o in objects:
        m = _module_of(o)
        if m:
            names.add(m)
    parts = []
    for name in sorted(names):
        mod = importlib.import_module(name)
        try:
            parts.append(name.encode() + Path(inspect.getsourcefile(mod)).read_bytes())
        except (TypeError, OSError):  # no source file (frozen): its name alone
            parts.append(name.encode())
    return _sha(*parts)


def run_fingerprint(model: nn.Module, train: Split, optimizer: torch.optim.Optimizer, *, loss_fn: Callable,
                    batch_size: int, lr_decay: float | None, seed: int, amp: bool,
                    before_step: Callable | None = None, on_epoch_end: Callable | None = None,
                    config: dict | None = None, augment: Callable | None = None) -> dict:
    """What decides a training run, epochs apart (a longer run of the same configuration
    continues a shorter one): the model's class and starting state (which covers its sizes,
    its seed and any warm start), optimiser and its settings, batch size, learning-rate decay,
    permutation seed, autocast, the training data, the loss and hooks (with the numbers they
    carry), ``config`` (anything else the caller names), the capslib code that computes the
    training and the torch version."""
    groups = [{k: _plain_value(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    opt = {"type": type(optimizer).__qualname__, **(groups[0] if len(groups) == 1 else
                                                     {f"group{i}": g for i, g in enumerate(groups)})}
    return {
        # the repr names what the state does not (routing iterations, a detach flag, a schedule)
        "model": f"{type(model).__qualname__}:{_state_digest(model)}:{_sha(repr(model).encode())[:12]}",
        "optimizer": opt,
        "batch_size": batch_size,
        "lr_decay": _plain_value(lr_decay),
        "seed": seed,
        "amp": bool(amp),
        "train": _data_digest(train),
        "loss": _describe_callable(loss_fn),
        "before_step": _describe_callable(before_step),
        "on_epoch_end": _describe_callable(on_epoch_end),
        **({"augment": _describe_callable(augment)} if augment is not None else {}),
        "config": json.loads(json.dumps(config, sort_keys=True, default=str)) if config else None,
        "code": _code_digest([model, *model.modules(), loss_fn, before_step, on_epoch_end, augment]),
        "torch": str(torch.__version__),
    }


def _short(v, width: int = 28) -> str:
    s = json.dumps(v, sort_keys=True) if not isinstance(v, str) else v
    return s if len(s) <= width else s[:width - 3] + "..."


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint_difference(old: dict | None, new: dict) -> str:
    """One phrase naming the fields in which two fingerprints differ (old -> new)."""
    if not old:
        return "it carries no configuration (written before checkpoints were keyed)"
    a, b = _flatten(old), _flatten(new)
    keys = [k for k in b if a.get(k) != b[k]] + [k for k in a if k not in b]
    return "differs in " + "; ".join(f"{k}: {_short(a.get(k))} -> {_short(b.get(k))}" for k in keys)


def _set_aside(path: Path) -> Path:
    """Rename a checkpoint that this run will not resume, so that nothing trained is lost."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    aside = path.with_name(f"{path.stem}.stale-{stamp}{path.suffix}")
    k = 1
    while aside.exists():
        aside = path.with_name(f"{path.stem}.stale-{stamp}-{k}{path.suffix}")
        k += 1
    os.replace(path, aside)
    return aside


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
        stop_when: ``stop_when(history) -> bool``, asked after each epoch (once its checkpoint is
            written) and after a resume: True ends the run before ``epochs`` (e.g. a baseline trained
            until its validation accuracy reaches a target). A resumed history that already satisfies
            it returns at once; one that does not trains on.
        amp: bf16 autocast on CUDA (default: on for CUDA).
        eval_batch_size: images per forward pass when ``val`` is scored after each epoch.
        compile: train through ``torch.compile(model, backend=compile_backend)`` (default: when
            ``$CAPSBOOK_COMPILE`` is set, see :func:`capslib.switches.compile_requested`). Off by
            default: the book's timings are eager. Checkpoints hold the plain model's weights.
        augment: ``augment(x) -> x`` applied to every training batch before the forward pass (e.g.
            :class:`capslib.data.RandomShift`, the paper's shifts); it joins the fingerprint.
        seed: seeds the minibatch permutations (default: the run's seed, :func:`capslib.switches.default_seed`).
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
    from . import switches
    step_model = model
    if switches.compile_requested() if compile is None else compile:
        step_model = torch.compile(model, backend=compile_backend)
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, lr_decay) if lr_decay else None
    if seed is None:
        seed = switches.default_seed()
    history: dict = {"loss": [], "train_acc": [], "val_acc": [], "seconds": [], "images_per_s": []}
    start = 0
    fingerprint = None
    if checkpoint is not None:
        fingerprint = run_fingerprint(model, train, optimizer, loss_fn=loss_fn, batch_size=batch_size,
                                      lr_decay=lr_decay, seed=seed, amp=amp, before_step=before_step,
                                      on_epoch_end=on_epoch_end, config=config, augment=augment)
        state, source = _resumable(Path(checkpoint), start_from, fingerprint, epochs, device)
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
    steps = math.ceil(n / batch_size)
    ranks = distributed_ranks()
    if ranks is not None:
        _broadcast_parameters(model)
        # each rank its own random stream for what a step draws (dropout masks), not the same masks W times
        torch.manual_seed(seed * 1009 + ranks[0])
        limit = None   # a time limit would stop one rank between collectives: not under torchrun
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
                   disable=not progress or tqdm is None or not switches.progress_bars(), mininterval=1.0)
        for s in bar:
            idx = perm[s * batch_size:(s + 1) * batch_size]
            xb, yb = train.x[idx], train.y[idx]
            if augment is not None:
                xb = augment(xb)
            share = 1.0
            if ranks is not None:   # data parallel: this rank's shard of the global batch
                shard = slice(ranks[0], None, ranks[1])
                share = len(yb[shard]) / len(yb)   # a rank's batch mean weighs its share of the global mean
                # a last batch smaller than the number of ranks leaves some rank nothing: it runs one image
                # at weight 0, so that every rank's gradients have the same structure for the sum
                xb, yb = (xb[shard], yb[shard]) if share > 0 else (xb[:1], yb[:1])
            with _autocast(device, amp):
                loss, scores = loss_fn(step_model, xb, yb)
            loss_d = loss.detach()
            optimizer.zero_grad(set_to_none=True)
            (loss * share if ranks is not None else loss).backward()
            if share > 0:
                nonfinite += (~torch.isfinite(loss_d)).long()
                total += loss_d.double() * len(yb)
                correct += (scores.detach().argmax(dim=1) == yb).sum()
            else:
                yb = yb[:0]
            if ranks is not None:
                _sum_gradients(model)
            if before_step is not None:
                before_step(model, optimizer)
            optimizer.step()
            seen += len(yb)
        if ranks is not None:
            total, correct, nonfinite, seen = _sum_over_ranks(total, correct, nonfinite, seen)
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


# ----------------------------------------------------------------------------- data parallel (torchrun)

def distributed_ranks() -> tuple[int, int] | None:
    """``(rank, world size)`` when :func:`fit` runs data-parallel: a ``torch.distributed`` process group
    of more than one process is initialised (``torchrun`` sets it up; :func:`init_distributed`). None
    otherwise.

    Under it every rank holds the whole training set and draws the same seeded permutation; each global
    batch (``batch_size`` images, augmented as one batch) is split by striding, rank ``r`` taking images
    ``r, r + W, ...``; each rank's batch-mean loss is weighted by its share of the batch and the
    gradients are summed over the ranks, so every rank takes the step one process would take on the
    global batch (up to the order of floating-point sums). Losses, accuracies and image counts are
    summed over ranks; rank 0 alone prints and writes checkpoints. Every rank must run the same code
    path (the same parameters receive gradients on each), and ``$CAPSBOOK_TIME_LIMIT`` is not applied.
    Dropout and other random draws inside a step use a stream of each rank's own."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def init_distributed() -> torch.device:
    """Join the process group ``torchrun`` describes (``$WORLD_SIZE`` > 1; NCCL on CUDA, gloo on the
    CPU) and return this rank's device; without ``torchrun``, the default device and no group."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    cuda = torch.cuda.is_available()
    dev = torch.device("cpu")
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dev


def _broadcast_parameters(model: nn.Module) -> None:
    import torch.distributed as dist

    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.data, src=0)


def _sum_gradients(model: nn.Module) -> None:
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def _sum_over_ranks(total, correct, nonfinite, seen: int):
    import torch.distributed as dist

    t = torch.stack([total.double(), correct.double(), nonfinite.double(),
                     torch.tensor(float(seen), dtype=torch.float64, device=total.device)])
    dist.all_reduce(t)
    return t[0], t[1].long(), t[2].long(), int(t[3])


def _resumable(path: Path, start_from, fingerprint: dict, epochs: int, device) -> tuple[dict | None, Path]:
    """The checkpoint state this run continues (or None) and the file it came from.

    ``path`` is resumed when its fingerprint matches and it holds at most ``epochs`` epochs;
    a mismatching ``path`` is set aside with one printed line. Without a usable ``path``,
    the matching ``start_from`` file with the most epochs (at most ``epochs``) is continued.
    """
    if path.exists():
        try:
            state = load_checkpoint(path, map_location=device)
        except Exception as err:  # noqa: BLE001 - truncated, foreign or unsafe files alike are not resumed
            state, why = None, f"it cannot be read ({type(err).__name__})"
        else:
            old = state.get("fingerprint") if isinstance(state, dict) else None
            trained = int(state.get("epoch", 0)) if isinstance(state, dict) else 0
            if old == fingerprint and trained <= epochs:
                return state, path
            why = (f"it holds {trained} epochs and this run asks for {epochs}" if old == fingerprint
                   else fingerprint_difference(old, fingerprint))
        aside = _set_aside(path)
        print(f"not resuming {path.name}: {why}; kept as {aside.name}, training from scratch")
    if start_from is None:
        return None, path
    starts = [start_from] if isinstance(start_from, (str, Path)) else list(start_from)
    best = None
    for p in map(Path, starts):
        if not p.exists():
            continue
        try:
            state = load_checkpoint(p, map_location=device)
        except Exception:  # noqa: BLE001 - an unreadable start is not continued
            continue
        if state.get("fingerprint") == fingerprint and int(state["epoch"]) <= epochs:
            if best is None or int(state["epoch"]) > int(best[0]["epoch"]):
                best = (state, p)
    return best if best is not None else (None, path)


def seconds_per_epoch(history: dict) -> float:
    """Median epoch time (the first epoch pays one-off warm-up costs)."""
    s = sorted(history["seconds"])
    if not s:
        return float("nan")
    return s[len(s) // 2]
