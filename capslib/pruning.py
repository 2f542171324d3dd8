"""The pruning REM trains with (chapter 6; Renzulli, Tartaglione & Grangetto).

A weight that is exactly zero makes a vote exactly zero, and a capsule whose votes are all zero
has the same couplings for every input (the paper's Eq. 7): that is why REM prunes while it
trains. Weights are pruned through ``torch.nn.utils.prune`` masks, so a pruned weight stays zero
while the network trains on. REM plugs in LOBSTER (Tartaglione et al. 2022). The controls chapter 6
sets beside it at the same sparsity (the step without its gate, magnitude pruning on a schedule,
SNIP) are experiment code, in :mod:`capslib.book.ch06`.

Contents:

* masks: :func:`prunable` (the weights chapter 6 prunes), :func:`effective_weight`,
  :func:`set_mask`, :func:`attach_masks`, :func:`sparsity`, :func:`global_magnitude_masks`,
  :func:`apply_global_magnitude`;
* LOBSTER: :func:`lobster_sensitivity`, :func:`lobster_step` (the shrinkage step),
  :func:`threshold_search` (bisection of the magnitude threshold on the validation margin loss,
  :func:`margin_loss_on`);
* the pruner for :func:`capslib.train.fit`: :class:`LobsterPruner` (REM).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn.utils import prune

from .layers import DenseCaps
from .ops import margin_loss
from .rem import predict_lengths


# ----------------------------------------------------------------------------- masks

def prunable(model: nn.Module, skip: Sequence[str] = ("decoder",)) -> list[tuple[nn.Module, str]]:
    """The weights that chapter 6 prunes: every ``Conv2d``/``Linear`` ``weight`` and every
    capsule layer's ``W``, outside the submodules named in ``skip`` (the decoder, which the
    paper removes). Biases are not pruned."""
    out = []
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            out.append((module, "weight"))
        elif isinstance(module, DenseCaps):
            out.append((module, "W"))
    if not out:
        raise ValueError("model has no prunable Conv2d/Linear weight or capsule W")
    return out


def _orig(module: nn.Module, name: str) -> torch.Tensor:
    """The trainable tensor behind ``module.name`` (``name_orig`` once pruned)."""
    return getattr(module, name + "_orig") if hasattr(module, name + "_mask") else getattr(module, name)


def effective_weight(module: nn.Module, name: str) -> torch.Tensor:
    """The weight the forward pass uses now: ``orig * mask`` when pruned (fresh, even
    between an optimizer step and the next forward)."""
    if hasattr(module, name + "_mask"):
        return getattr(module, name + "_orig") * getattr(module, name + "_mask")
    return getattr(module, name)


def set_mask(module: nn.Module, name: str, mask: torch.Tensor) -> None:
    """Install (first call: ``prune.custom_from_mask``) or replace the pruning mask of ``module.name``."""
    w = _orig(module, name)
    if mask.shape != w.shape:
        raise ValueError(f"mask for {type(module).__name__}.{name} must be {tuple(w.shape)}; got {tuple(mask.shape)}")
    mask = mask.to(device=w.device, dtype=w.dtype)
    if hasattr(module, name + "_mask"):
        getattr(module, name + "_mask").copy_(mask)
        setattr(module, name, getattr(module, name + "_orig") * getattr(module, name + "_mask"))
    else:
        prune.custom_from_mask(module, name, mask)


def attach_masks(params: list[tuple[nn.Module, str]]) -> None:
    """Give every parameter an all-ones mask (so checkpoints of pruned and not-yet-pruned
    runs share one layout)."""
    for module, name in params:
        if not hasattr(module, name + "_mask"):
            set_mask(module, name, torch.ones_like(_orig(module, name)))


def sparsity(params: list[tuple[nn.Module, str]]) -> float:
    """Fraction of the weights in ``params`` that are exactly zero (the paper's "sparsity")."""
    zeros = total = 0
    for module, name in params:
        w = effective_weight(module, name)
        zeros += int((w == 0).sum())
        total += w.numel()
    return zeros / max(total, 1)


def global_magnitude_masks(params: list[tuple[nn.Module, str]], fraction: float) -> list[torch.Tensor]:
    """Masks that zero the ``fraction`` of all weights in ``params`` with the smallest
    magnitude, one threshold for all layers (weights already zero count among them)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1]; got {fraction}")
    ws = [effective_weight(m, n).detach() for m, n in params]
    scores = torch.cat([w.abs().flatten() for w in ws])
    k = int(round(fraction * scores.numel()))
    if k == 0:
        return [torch.ones_like(w) for w in ws]
    threshold = torch.kthvalue(scores.float().cpu(), k).values.item()
    masks = []
    for w in ws:
        masks.append(((w.abs() > threshold) & (w != 0)).to(w.dtype))
    return masks


def apply_global_magnitude(params: list[tuple[nn.Module, str]], fraction: float) -> None:
    """Prune to (at least) ``fraction`` sparsity by global magnitude; never revives a pruned weight."""
    for (module, name), mask in zip(params, global_magnitude_masks(params, fraction)):
        old = getattr(module, name + "_mask", None)
        set_mask(module, name, mask if old is None else mask * old)


# ----------------------------------------------------------------------------- LOBSTER

SENSITIVITIES = ("raw", "max", "none")


def lobster_sensitivity(grad: torch.Tensor, kind: str | None = "max") -> torch.Tensor:
    """The sensitivity ``S`` in LOBSTER's gate ``max(0, 1 - S)`` (chapter 6), per weight.

    ``"raw"`` (or ``None``): ``|dL/dp|`` as printed. On chapter 6's ``ci`` CapsNet the largest
    ``|dL/dp|`` is about 1e-2, so the gate is about 1 for every weight and the step is plain
    weight decay. ``"max"``: ``|dL/dp|`` divided by the largest ``|dL/dp|`` of the same tensor,
    so ``S`` lies in ``[0, 1]`` whatever the loss's scale: the most sensitive weight of each
    tensor is left alone and the rest shrink in proportion to ``1 - S`` (the rescaling of the
    public LOBSTER code of EIDOSLab, the REM authors' lab, its ``rescaled`` option; the papers do
    not print it; no new hyperparameter, and the gate never clips). ``"none"``: ``S = 0``, the gate is 1,
    i.e. plain weight decay (the ablation)."""
    if kind in (None, "raw"):
        return grad.abs()
    if kind == "max":
        g = grad.abs()
        top = g.max()
        return g / top if float(top) > 0 else torch.zeros_like(g)
    if kind == "none":
        return torch.zeros_like(grad)
    raise ValueError(f"kind must be one of {SENSITIVITIES} or None; got {kind!r}")


def lobster_step(params: list[tuple[nn.Module, str]], lam: float, sensitivity: str | None = None,
                 active_below: float = 0.99) -> dict:
    """LOBSTER's sensitivity step (Tartaglione et al. 2022; chapter 6), after ``backward``
    and before the optimizer step: ``p <- p - lam * p * max(0, 1 - S(p))`` with ``S`` from
    :func:`lobster_sensitivity` (default ``"raw"``: ``S = |dL/dp|``).

    Weights the loss is insensitive to shrink towards zero; weights with ``S >= 1`` are left
    alone. Returns the share of weights whose gate ``max(0, 1 - S)`` is below ``active_below``
    with the raw sensitivity and with the one applied, and the mean gate applied, all over the live
    weights: ``{"raw": ..., "applied": ..., "mean_gate": ...}`` (a mean gate of 1 is weight decay).
    """
    n = active_raw = active = 0
    gate_sum = 0.0
    with torch.no_grad():
        for module, name in params:
            p = _orig(module, name)
            if p.grad is None:
                continue
            gate_raw = (1.0 - p.grad.abs()).clamp_min(0.0)
            gate = gate_raw if sensitivity in (None, "raw") else \
                (1.0 - lobster_sensitivity(p.grad, sensitivity)).clamp_min(0.0)
            live = _live(module, name)
            n += int(live.sum())
            active_raw += int(((gate_raw < active_below) & live).sum())
            active += int(((gate < active_below) & live).sum())
            gate_sum += float((gate * live).sum())
            p.sub_(lam * p * gate)
    return {"raw": active_raw / max(n, 1), "applied": active / max(n, 1), "mean_gate": gate_sum / max(n, 1)}


def _live(module: nn.Module, name: str) -> torch.Tensor:
    """Boolean mask of the weights not pruned yet."""
    mask = getattr(module, name + "_mask", None)
    return torch.ones_like(_orig(module, name), dtype=torch.bool) if mask is None else mask.bool()


@torch.no_grad()
def margin_loss_on(model: nn.Module, split, batch_size: int = 500) -> float:
    """Mean margin loss of a CapsNet-like ``model`` (``model(x)[0]`` are lengths) on ``split``."""
    was = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(split), batch_size):
        x, y = split.x[i:i + batch_size], split.y[i:i + batch_size]
        total += float(margin_loss(predict_lengths(model, x), y)) * len(y)
    model.train(was)
    return total / max(len(split), 1)


def threshold_search(model: nn.Module, params: list[tuple[nn.Module, str]], val, tolerance: float = 0.0,
                     steps: int = 8) -> float:
    """LOBSTER's pruning stage as chapter 6 uses it: bisection for the largest global
    magnitude threshold (expressed as the fraction of weights below it) whose validation
    margin loss stays within ``(1 + tolerance)`` of the loss before pruning. Prunes there
    (or nowhere) and returns the new sparsity."""
    attach_masks(params)
    limit = margin_loss_on(model, val) * (1.0 + tolerance)
    saved = [getattr(m, n + "_mask").clone() for m, n in params]

    def prune_to(fraction):
        for (m, n), old in zip(params, saved):
            set_mask(m, n, old)
        apply_global_magnitude(params, fraction)

    lo, hi = sparsity(params), 1.0
    best = lo
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        prune_to(mid)
        if margin_loss_on(model, val) <= limit:
            best, lo = mid, mid
        else:
            hi = mid
    prune_to(best)
    return sparsity(params)


# ----------------------------------------------------------------------------- pruners

class LobsterPruner:
    """REM's pruning (chapter 6): LOBSTER (Tartaglione et al. 2022), the method the book plugs in.

    ``before_step`` applies :func:`lobster_step` with ``lam`` (decayed by ``decay`` after
    every epoch) and the given ``sensitivity``; ``on_epoch_end`` runs :func:`threshold_search`
    on ``val`` and records the sparsity in ``history["sparsity"]`` and, in ``history["gate_active"]``,
    the epoch's means of :func:`lobster_step`'s record (``{"raw", "applied", "mean_gate"}`` per epoch).
    Pass both to :func:`capslib.train.fit`.
    """

    def __init__(self, params, val, lam: float = 1e-4, decay: float = 0.99, tolerance: float = 0.0,
                 steps: int = 8, sensitivity: str | None = None):
        self.params, self.val = params, val
        self.lam0, self.lam, self.decay = lam, lam, decay
        self.tolerance, self.steps = tolerance, steps
        self.sensitivity = sensitivity
        self._gates: list[dict] = []
        attach_masks(params)

    def before_step(self, model, optimizer) -> None:
        self._gates.append(lobster_step(self.params, self.lam, self.sensitivity))

    def _record_gates(self, history) -> None:
        if self._gates:
            history.setdefault("gate_active", []).append(
                {k: sum(g[k] for g in self._gates) / len(self._gates) for k in self._gates[0]})
        self._gates = []

    def on_epoch_end(self, epoch, model, history) -> None:
        self._record_gates(history)
        s = threshold_search(model, self.params, self.val, self.tolerance, self.steps)
        history.setdefault("sparsity", []).append(s)
        self.lam = self.lam0 * self.decay ** (epoch + 1)
