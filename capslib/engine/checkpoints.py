"""Checkpoints of :func:`capslib.train.fit`: written atomically, keyed by the run that wrote them.

Checkpoints are written atomically (temporary file, then ``os.replace``) and read with
``torch.load(..., weights_only=True)``. Each one carries the fingerprint of the run that wrote it
(:func:`run_fingerprint`): a run resumes only a checkpoint of its own configuration
(:func:`resumable`); any other is moved aside (kept, never overwritten) and the run starts over.
Where a run keeps its checkpoints is :func:`capslib.train.checkpoint_path`.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..datasets import Split


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
_CORE_MODULES = ("capslib.ops", "capslib.routing", "capslib.layers", "capslib.train", "capslib.engine.steps",
                 "capslib.engine.distributed")


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


def _number(v):
    """A one-element tensor (a learning rate kept on the device) as its Python number; else ``v``."""
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


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
                    config: dict | None = None, augment: Callable | None = None,
                    static_batches: bool = False) -> dict:
    """What decides a training run, epochs apart (a longer run of the same configuration
    continues a shorter one): the model's class and starting state (which covers its sizes,
    its seed and any warm start), optimiser and its settings, batch size, learning-rate decay,
    permutation seed, autocast, the training data, the loss and hooks (with the numbers they
    carry), ``config`` (anything else the caller names), the capslib code that computes the
    training and the torch version. ``static_batches``: the fast path's batching (every step
    ``batch_size`` images, the last partial batch dropped, :mod:`capslib.engine.steps`), named only when on.
    A learning rate held in a one-element tensor (the captured step's) counts as its number."""
    groups = [{k: _plain_value(_number(v)) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
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
        **({"static_batches": True} if static_batches else {}),
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


def resumable(path: Path, start_from, fingerprint: dict, epochs: int, device) -> tuple[dict | None, Path]:
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
