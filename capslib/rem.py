"""REM: routing entropy minimization (chapter 6; Renzulli, Tartaglione & Grangetto).

A CapsNet is pruned while it trains; its last-iteration couplings are quantized
into ``K`` uniform levels (Eq. 13); for each predicted class the strings of
quantized couplings ``c~[:, y_hat]`` form a dictionary of parse trees whose
entropy (Eq. 14, averaged over classes by Eq. 15) measures how many different
trees the routing carves out of the network.

Shapes use the book's letters: ``B`` batch, ``N`` samples, ``I`` input capsules,
``J`` output capsules (classes), ``D`` capsule dimension.

Contents:

* quantization and dictionaries: :func:`quantize`, :func:`parse_tree_entropy`,
  :func:`count_parse_trees`, :func:`parse_tree_dictionary`, :class:`QuantizedRouting`;
* pruning through ``torch.nn.utils.prune`` masks: :func:`prunable`,
  :func:`sparsity`, :func:`global_magnitude_masks`, :class:`LobsterPruner`
  (sensitivity step + bisection of the magnitude threshold on the validation loss),
  :class:`MagnitudeSchedulePruner` (plain iterative magnitude pruning),
  :func:`snip_masks` (single shot at initialization);
* measurements: :func:`level_sweep`, :class:`LevelTracker`, :func:`saliency_maps` (Eq. 16);
* the multi-layer fully connected DR-CapsNet :class:`FCCapsNet` and its parse-tree
  graphs :func:`parse_tree_graph`, :func:`draw_parse_tree`.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

from .checks import check_positive_int, check_tensor
from .layers import DenseCaps
from .ops import margin_loss, squash
from .routing import dynamic_routing

# ----------------------------------------------------------------------------- sizes



# ----------------------------------------------------------------------------- quantization

def quantize(c: torch.Tensor, levels: int = 11) -> torch.Tensor:
    """Uniform quantizer ``q_K`` of Eq. 13 (chapter 6): the index ``round(c * (K - 1))``.

    Couplings in ``[0, 1]`` (any shape, e.g. ``(B, I, J)``) map to a LongTensor of the
    same shape with values in ``[0, K)``; level ``k`` stands for the value ``k / (K - 1)``.
    Rounding is to the nearest level (ties to even, as ``torch.round``); values outside
    ``[0, 1]`` are clamped.
    """
    check_tensor("c", c, floating=True)
    check_positive_int("levels", levels, minimum=2)
    return torch.round(c.detach() * (levels - 1)).clamp_(0, levels - 1).long()


def dequantize(codes: torch.Tensor, levels: int = 11, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The coupling values ``k / (K - 1)`` that the indices ``codes`` stand for (Eq. 13)."""
    check_tensor("codes", codes)
    check_positive_int("levels", levels, minimum=2)
    return codes.to(dtype) / (levels - 1)


def _check_codes(codes: torch.Tensor, predicted: torch.Tensor, num_classes: int) -> None:
    check_tensor("codes", codes, dims=2, shape_doc="(N, I) quantization indices")
    if codes.is_floating_point() or codes.dtype == torch.bool:
        raise TypeError(f"codes must hold integer quantization indices; got dtype {codes.dtype}")
    check_tensor("predicted", predicted, dims=1, shape_doc="(N,) predicted classes")
    if predicted.is_floating_point():
        raise TypeError(f"predicted must hold integer class indices; got dtype {predicted.dtype}")
    check_positive_int("num_classes", num_classes)
    if predicted.shape[0] != codes.shape[0]:
        raise ValueError(f"predicted must be (N,) with N = codes.shape[0] = {codes.shape[0]}; "
                         f"got {tuple(predicted.shape)}")
    if predicted.numel() and (predicted.min() < 0 or predicted.max() >= num_classes):
        raise ValueError(f"predicted must hold classes in [0, {num_classes}); "
                         f"got values in [{int(predicted.min())}, {int(predicted.max())}]")


def _tree_counts(codes: torch.Tensor, predicted: torch.Tensor):
    """Unique (class, key) rows and how often each occurs."""
    rows = torch.cat([predicted.long().unsqueeze(1), codes.long()], dim=1)
    uniq, counts = torch.unique(rows, dim=0, return_counts=True)
    return uniq[:, 0], counts


def parse_tree_entropy(codes: torch.Tensor, predicted: torch.Tensor, num_classes: int):
    """Entropy of the parse-tree dictionary per class (Eq. 14) and its class mean (Eq. 15).

    Args:
        codes: ``(N, I)`` quantization indices ``c~[:, y_hat]`` of each sample, the
            couplings of every input capsule to the predicted class (the key of the sample).
        predicted: ``(N,)`` predicted classes ``y_hat``.
        num_classes: ``J``.

    Returns:
        ``(per_class, mean)``: ``per_class`` is a float64 tensor ``(J,)`` with
        ``H_j = -sum_k P(key_k | y_hat = j) log2 P(key_k | y_hat = j)`` in bits (0 for a
        class that no sample was predicted as); ``mean`` is the 0-d tensor ``(1/J) sum_j H_j``.
    """
    _check_codes(codes, predicted, num_classes)
    per_class = torch.zeros(num_classes, dtype=torch.float64, device=codes.device)
    if codes.shape[0] == 0:
        return per_class, per_class.mean()
    cls, counts = _tree_counts(codes, predicted)
    n_j = torch.bincount(predicted.long(), minlength=num_classes).to(torch.float64)
    p = counts.to(torch.float64) / n_j[cls]
    per_class.index_add_(0, cls, -p * torch.log2(p))
    return per_class, per_class.mean()


def miller_madow_entropy(codes: torch.Tensor, predicted: torch.Tensor, num_classes: int):
    """Bias-corrected entropy of each class's dictionary (chapter 6): the plug-in entropy of
    :func:`parse_tree_entropy` plus Miller and Madow's correction ``(m_j - 1) / (2 n_j ln 2)`` bits,
    with ``m_j`` distinct keys among ``n_j`` samples (0 for a class with no sample).
    The plug-in estimate is biased low by about that much when keys are seen few times each.

    Returns ``(per_class, mean)`` like :func:`parse_tree_entropy`."""
    per_class, _ = parse_tree_entropy(codes, predicted, num_classes)
    m = count_parse_trees(codes, predicted, num_classes).to(torch.float64)
    n = torch.bincount(predicted.long(), minlength=num_classes).to(torch.float64).to(per_class.device)
    corr = torch.where(n > 0, (m - 1).clamp_min(0) / (2 * n.clamp_min(1) * math.log(2)), torch.zeros_like(n))
    per_class = per_class + corr
    return per_class, per_class.mean()


def entropy_ceiling(predicted: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``log2 n_j`` per class: the largest plug-in entropy ``n_j`` samples can show (one key each)."""
    n = torch.bincount(predicted.long(), minlength=num_classes).to(torch.float64)
    return torch.where(n > 0, torch.log2(n.clamp_min(1)), torch.zeros_like(n))


def count_parse_trees(codes: torch.Tensor, predicted: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Number of distinct keys (parse trees) in the dictionary of each class, ``(J,)`` (Fig. 9, Table 11)."""
    _check_codes(codes, predicted, num_classes)
    if codes.shape[0] == 0:
        return torch.zeros(num_classes, dtype=torch.long, device=codes.device)
    cls, _ = _tree_counts(codes, predicted)
    return torch.bincount(cls, minlength=num_classes)


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def key_string(code_row: torch.Tensor) -> str:
    """The dictionary key of one sample: its quantization indices as a string
    (one character per input capsule in base 36 when ``K <= 36``, else dot-separated)."""
    vals = [int(v) for v in code_row.tolist()]
    if vals and max(vals) < len(_DIGITS):
        return "".join(_DIGITS[v] for v in vals)
    return ".".join(str(v) for v in vals)


def parse_tree_dictionary(codes: torch.Tensor, predicted: torch.Tensor, num_classes: int) -> list[dict]:
    """The dictionaries themselves (Sec. 3.1.3): for each class, ``{key string: count}``,
    most frequent key first."""
    _check_codes(codes, predicted, num_classes)
    out: list[dict] = [dict() for _ in range(num_classes)]
    if codes.shape[0] == 0:
        return out
    rows = torch.cat([predicted.long().unsqueeze(1), codes.long()], dim=1)
    uniq, counts = torch.unique(rows, dim=0, return_counts=True)
    order = torch.argsort(counts, descending=True, stable=True)
    for k in order.tolist():
        out[int(uniq[k, 0])][key_string(uniq[k, 1:])] = int(counts[k])
    return out


class QuantizedRouting:
    """Dynamic routing whose last-iteration couplings are quantized (Eq. 13; chapter 6).

    Iterations ``1 .. r-1`` run as Procedure 1 of Sabour et al.; in the last one the
    couplings ``c`` are replaced by ``c~ = q_K(c) / (K - 1)`` before
    ``s_j = sum_i c~_ij u_hat_{j|i}`` and ``v_j = squash(s_j)``. Use it as
    ``model.digit.routing_fn = QuantizedRouting(11)`` at inference: the accuracy of the
    model is then the "+Q" accuracy. The quantizer has zero gradient, so the couplings
    are constants for back-propagation whatever ``detach`` says.

    ``__call__(u_hat (B, I, J, D), iterations, detach) -> (v (B, J, D), c~ (B, I, J))``.
    """

    def __init__(self, levels: int = 11):
        check_positive_int("levels", levels, minimum=2)
        self.levels = levels

    def __call__(self, u_hat: torch.Tensor, iterations: int = 3, detach: bool = False):
        check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
        check_positive_int("iterations", iterations)
        with torch.no_grad():
            _, c = dynamic_routing(u_hat.detach(), iterations)          # Eqs. 2-5, last iteration's c
            c_q = dequantize(quantize(c, self.levels), self.levels, u_hat.dtype)  # Eq. 13
        v = squash(torch.einsum("bij,bijd->bjd", c_q, u_hat))
        return v, c_q

    def __repr__(self) -> str:
        return f"QuantizedRouting(levels={self.levels})"


def capsule_layers(model: nn.Module) -> list[DenseCaps]:
    """Every routed capsule layer of ``model`` (one for CapsNet, four for :class:`FCCapsNet`)."""
    return [m for m in model.modules() if isinstance(m, DenseCaps)]


def set_routing(model: nn.Module, routing_fn: Callable | None) -> None:
    """Set ``routing_fn`` on every capsule layer (None: plain dynamic routing)."""
    from .routing import dynamic_routing

    for layer in capsule_layers(model):
        layer.routing_fn = routing_fn or dynamic_routing


# ----------------------------------------------------------------------------- pruning

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


SENSITIVITIES = ("raw", "max", "none")


def lobster_sensitivity(grad: torch.Tensor, kind: str | None = "max") -> torch.Tensor:
    """The sensitivity ``S`` in LOBSTER's gate ``max(0, 1 - S)`` (chapter 6), per weight.

    ``"raw"`` (or ``None``): ``|dL/dp|`` as printed. On chapter 6's ``ci`` CapsNet the largest
    ``|dL/dp|`` is about 1e-2, so the gate is about 1 for every weight and the step is plain
    weight decay. ``"max"``: ``|dL/dp|`` divided by the largest ``|dL/dp|`` of the same tensor,
    so ``S`` lies in ``[0, 1]`` whatever the loss's scale: the most sensitive weight of each
    tensor is left alone and the rest shrink in proportion to ``1 - S`` (the book's choice; no
    new hyperparameter, and the gate never clips). ``"none"``: ``S = 0``, the gate is 1,
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
    with the raw sensitivity and with the one applied: ``{"raw": ..., "applied": ...}``.
    """
    n = active_raw = active = 0
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
            p.sub_(lam * p * gate)
    return {"raw": active_raw / max(n, 1), "applied": active / max(n, 1)}


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
        total += float(margin_loss(_lengths(model, x), y)) * len(y)
    model.train(was)
    return total / max(len(split), 1)


def _lengths(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "encode") and hasattr(model, "primary"):
        v, _ = model.encode(x)          # CapsNet: skip the decoder
        return v.norm(dim=-1)
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out[0]


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


class LobsterPruner:
    """REM's pruning (chapter 6): LOBSTER (Tartaglione et al. 2022), the method the book plugs in.

    ``before_step`` applies :func:`lobster_step` with ``lam`` (decayed by ``decay`` after
    every epoch) and the given ``sensitivity``; ``on_epoch_end`` runs :func:`threshold_search`
    on ``val`` and records the sparsity in ``history["sparsity"]`` and the epoch's mean share of
    gates below 0.99 in ``history["gate_active"]`` (``{"raw", "applied"}`` per epoch).
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
                {k: sum(g[k] for g in self._gates) / len(self._gates) for k in ("raw", "applied")})
        self._gates = []

    def on_epoch_end(self, epoch, model, history) -> None:
        self._record_gates(history)
        s = threshold_search(model, self.params, self.val, self.tolerance, self.steps)
        history.setdefault("sparsity", []).append(s)
        self.lam = self.lam0 * self.decay ** (epoch + 1)


class MatchedPruner(LobsterPruner):
    """Chapter 6's ablation at matched sparsity: an optional shrinkage step (:func:`lobster_step`
    with ``sensitivity``; ``lam = 0`` for none), and after each epoch global magnitude pruning to
    the next sparsity in ``targets`` (e.g. the sparsities REM reached after each of its epochs),
    whatever the loss says."""

    def __init__(self, params, targets: Sequence[float], lam: float = 0.0, decay: float = 0.99,
                 sensitivity: str | None = "none"):
        super().__init__(params, None, lam=lam, decay=decay, sensitivity=sensitivity)
        self.targets = list(targets)

    def before_step(self, model, optimizer) -> None:
        if self.lam > 0:
            super().before_step(model, optimizer)

    def on_epoch_end(self, epoch, model, history) -> None:
        self._record_gates(history)
        done = len(history.get("sparsity", []))
        apply_global_magnitude(self.params, self.targets[min(done, len(self.targets) - 1)])
        history.setdefault("sparsity", []).append(sparsity(self.params))
        self.lam = self.lam0 * self.decay ** (epoch + 1)


class MagnitudeSchedulePruner:
    """Plain iterative magnitude pruning (chapter 6): after epoch ``e`` of ``epochs``, prune
    globally by magnitude to ``final * (e + 1) / epochs`` sparsity, whatever the loss says."""

    def __init__(self, params, final: float, epochs: int, start_epoch: int = 0):
        if not 0.0 <= final < 1.0:
            raise ValueError(f"final must be in [0, 1); got {final}")
        self.params, self.final, self.epochs, self.start = params, final, epochs, start_epoch
        attach_masks(params)

    def target(self, epoch: int) -> float:
        done = min(epoch + 1 - self.start, self.epochs)
        return self.final * max(done, 0) / self.epochs

    def on_epoch_end(self, epoch, model, history) -> None:
        apply_global_magnitude(self.params, self.target(epoch))
        history.setdefault("sparsity", []).append(sparsity(self.params))


def snip_masks(model: nn.Module, params, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
               fraction: float) -> list[torch.Tensor]:
    """SNIP (Lee et al. 2019; chapter 6): connection sensitivity ``|dL/dw * w|`` on one
    batch at initialization; keep the ``1 - fraction`` most sensitive weights, globally."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1); got {fraction}")
    model.zero_grad(set_to_none=True)
    loss, _ = loss_fn(model, x, y)
    tensors = [_orig(m, n) for m, n in params]
    grads = torch.autograd.grad(loss, tensors)
    scores = [(g * w).abs().detach() for g, w in zip(grads, tensors)]
    flat = torch.cat([s.flatten() for s in scores])
    k = int(round(fraction * flat.numel()))
    if k == 0:
        return [torch.ones_like(s) for s in scores]
    threshold = torch.kthvalue(flat.float().cpu(), k).values.item()
    return [(s > threshold).to(s.dtype) for s in scores]


def chain(*callbacks: Callable | None) -> Callable:
    """One ``on_epoch_end`` that calls several in order (None entries skipped)."""
    cbs = [c for c in callbacks if c is not None]

    def run(epoch, model, history):
        for cb in cbs:
            cb(epoch, model, history)
    return run


# ----------------------------------------------------------------------------- measurements

def margin_loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """``loss_fn`` for :func:`capslib.train.fit`: margin loss only (no decoder, App. C.2)."""
    lengths = _lengths(model, x)
    return margin_loss(lengths, y), lengths


def predict_lengths(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``predict`` for :func:`capslib.train.evaluate`: class-capsule lengths ``(B, J)``."""
    return _lengths(model, x)


@torch.no_grad()
def last_couplings(model: nn.Module, x: torch.Tensor):
    """For a CapsNet: primary capsules ``u (B, I, D_in)``, votes ``u_hat (B, I, J, D)`` and
    the continuous couplings of the last routing iteration ``c (B, I, J)``."""
    u = model.primary_capsules(x)
    u_hat = model.digit.votes(u)          # honours pruning masks (DenseCaps.votes)
    _, c = dynamic_routing(u_hat, model.digit.iterations)
    return u, u_hat, c


@torch.no_grad()
def level_sweep(model: nn.Module, split, levels: Sequence[int] = (11,), batch_size: int = 250) -> dict:
    """Accuracy, entropy (Eq. 14-15) and keys per class of a CapsNet whose last couplings
    are quantized with each ``K`` in ``levels`` (Fig. 7), from one pass of the
    convolutions and votes. Returns ``{"float": {"accuracy"}, K: {"accuracy", "entropy",
    "entropy_mm", "per_class", "keys", "codes", "predicted", "c"}}`` (``entropy_mm``: Miller-Madow) where ``c (N, I)`` are the continuous
    couplings to the class the quantized model predicts and ``codes`` their indices."""
    was = model.training
    model.eval()
    J = model.digit.out_caps
    parts: dict = {K: {"pred": [], "codes": [], "c": []} for K in levels}
    correct_float = 0
    for i in range(0, len(split), batch_size):
        x, y = split.x[i:i + batch_size], split.y[i:i + batch_size]
        _, u_hat, c = last_couplings(model, x)
        v = squash(torch.einsum("bij,bijd->bjd", c, u_hat))
        correct_float += int((v.norm(dim=-1).argmax(1) == y).sum())
        for K in levels:
            codes = quantize(c, K)                                          # Eq. 13
            v = squash(torch.einsum("bij,bijd->bjd", dequantize(codes, K, u_hat.dtype), u_hat))
            pred = v.norm(dim=-1).argmax(dim=1)
            idx = pred.view(-1, 1, 1).expand(-1, c.shape[1], 1)
            parts[K]["pred"].append(pred)
            parts[K]["codes"].append(codes.gather(2, idx).squeeze(2))      # c~[:, y_hat]
            parts[K]["c"].append(c.gather(2, idx).squeeze(2))
    model.train(was)
    out: dict = {"float": {"accuracy": correct_float / max(len(split), 1)}}
    for K in levels:
        pred = torch.cat(parts[K]["pred"])
        codes = torch.cat(parts[K]["codes"])
        per_class, mean = parse_tree_entropy(codes, pred, J)
        _, mean_mm = miller_madow_entropy(codes, pred, J)
        out[K] = {"accuracy": float((pred == split.y).float().mean()), "entropy": float(mean),
                  "entropy_mm": float(mean_mm),
                  "per_class": per_class.tolist(), "keys": count_parse_trees(codes, pred, J).tolist(),
                  "codes": codes, "predicted": pred, "c": torch.cat(parts[K]["c"])}
    return out


class LevelTracker:
    """``on_epoch_end`` that appends, after every epoch, the quantized accuracy, entropy and
    keys per class for each ``K`` on ``split`` to ``history["levels"]`` (Fig. 8 and 10)."""

    def __init__(self, split, levels: Sequence[int] = (11,), params=None):
        self.split, self.levels, self.params = split, tuple(levels), params

    def __call__(self, epoch, model, history) -> None:
        res = level_sweep(model, self.split, self.levels)
        history.setdefault("levels", []).append(
            {str(K): {k: res[K][k] for k in ("accuracy", "entropy", "entropy_mm", "keys")} for K in self.levels})
        if self.params is not None and "sparsity" not in history:
            history.setdefault("weight_sparsity", []).append(sparsity(self.params))


@torch.no_grad()
def saliency_maps(model: nn.Module, x: torch.Tensor, levels: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Saliency maps of Eq. 16 (chapter 6) for a CapsNet: at each grid position ``(m, n)``
    the mean over the ``O`` capsule types of ``||u_(m,n,o)|| * c~_(m,n,o), y_hat``, bilinearly
    upsampled to the input size.

    ``x (B, C, H, W)`` -> ``(E (B, H, W), y_hat (B,))``.
    """
    check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
    u, u_hat, c = last_couplings(model, x)
    codes = quantize(c, levels)
    c_q = dequantize(codes, levels, u.dtype)
    v = squash(torch.einsum("bij,bijd->bjd", c_q, u_hat))
    pred = v.norm(dim=-1).argmax(dim=1)
    B, I, _ = u.shape
    O = model.primary.types
    side = int(round(math.sqrt(I // O)))
    if O * side * side != I:
        raise ValueError(f"primary capsules do not form an O x M x N grid: I={I}, O={O}")
    weight = u.norm(dim=-1) * c_q.gather(2, pred.view(-1, 1, 1).expand(-1, I, 1)).squeeze(2)
    E = weight.view(B, O, side, side).mean(dim=1)                          # Eq. 16
    E = F.interpolate(E.unsqueeze(1), size=x.shape[-2:], mode="bilinear", align_corners=False).squeeze(1)
    return E, pred


# ----------------------------------------------------------------------------- the experiment

METHODS = ("vanilla (+Q)", "REM (LOBSTER)", "IMP", "SNIP")
#: the ablation run of chapter 6 (trained when the settings have ``ablation=True``): LOBSTER's
#: shrinkage with the gate removed (plain weight decay), pruned by magnitude to REM's sparsities
WEIGHT_DECAY = "weight decay"


def make_capsnet(S, seed: int, device=None) -> nn.Module:
    """Chapter 6's DR-CapsNet without decoder at the sizes of settings ``S``, initialised from ``seed``."""
    from .models import CapsNet

    torch.manual_seed(seed)
    net = CapsNet(conv_channels=S.conv_channels, primary_types=S.primary_types, primary_dim=S.primary_dim,
                  digit_dim=S.digit_dim, decoder=(), iterations=S.iterations)
    return net.to(device) if device is not None else net


def encoder_parameters(net: nn.Module, nonzero: bool = False) -> int:
    """Parameters of a CapsNet's encoder (convolution, primary capsules, class capsules); no decoder."""
    from .models import count_parameters

    return sum(count_parameters(m, nonzero=nonzero) for m in (net.conv, net.primary, net.digit))


def compare_methods(seed: int, S, train_split, val, test, *, track: bool = False, device=None,
                    progress: bool = True, report_val: bool = False, prefix: str = "06_rem") -> dict:
    """Chapter 6's experiment for one seed: vanilla, REM (LOBSTER), IMP and SNIP DR-CapsNets.

    The vanilla network trains ``S.epochs`` epochs; its first ``S.pretrain_epochs`` are a shared
    start from which REM and IMP branch and train the remaining epochs (every network sees
    ``S.epochs`` epochs); SNIP prunes the initial weights to the sparsity REM ended with and
    trains ``S.epochs`` epochs from there. Every run is train-or-load through keyed checkpoints
    named ``{prefix}_<run>_s{seed}``; the seed fixes the initial weights and the minibatch order.
    ``track`` records, after every epoch, the test accuracy, entropy and keys for each ``K`` in
    ``S.levels_sweep`` (``history["levels"]``, :class:`LevelTracker`). ``val`` guards LOBSTER's
    threshold; ``report_val`` also scores it after every epoch of every run (``history["val_acc"]``).

    Returns ``{"seed", "nets": {method: model}, "params": {method: pruned weights or None},
    "history": {"start", method: history}, "seconds": {method: wall seconds}}`` (methods:
    :data:`METHODS`; the vanilla history continues the start's, so it holds all ``S.epochs``).
    """
    import copy
    import time

    from . import train as _train

    def tracker():
        return LevelTracker(test, S.levels_sweep) if track else None

    fit_args = dict(batch_size=S.batch_size, lr=S.lr, lr_decay=S.lr_decay, val=val if report_val else None,
                    predict=predict_lengths,
                    seed=seed, progress=progress)
    ckpt = lambda name: _train.checkpoint_path(f"{prefix}_{name}_s{seed}")
    rest = S.epochs - S.pretrain_epochs
    nets, params, hist, secs = {}, {}, {}, {}

    t0 = time.perf_counter()
    vanilla = make_capsnet(S, seed, device)
    start_ckpt = ckpt("start")
    hist["start"] = _train.fit(vanilla, train_split, margin_loss_fn, epochs=S.pretrain_epochs, checkpoint=start_ckpt,
                               on_epoch_end=tracker(), desc=f"shared start (seed {seed})", **fit_args)
    shared_start = copy.deepcopy(vanilla.state_dict())
    vanilla = make_capsnet(S, seed, device)  # the same initial weights: the vanilla run continues the start
    hist[METHODS[0]] = _train.fit(vanilla, train_split, margin_loss_fn, epochs=S.epochs, checkpoint=ckpt("vanilla"),
                                  start_from=start_ckpt, on_epoch_end=tracker(), desc=f"vanilla (seed {seed})",
                                  **fit_args)
    nets[METHODS[0]], params[METHODS[0]] = vanilla, None
    secs[METHODS[0]] = time.perf_counter() - t0

    def branch(method: str, run: str, pruner_for, tracked: bool = True) -> list:
        """Continue the shared start with a pruner made by ``pruner_for(prunable weights)``."""
        t0 = time.perf_counter()
        net = make_capsnet(S, seed, device)
        net.load_state_dict(shared_start)
        pruned = prunable(net)
        pruner = pruner_for(pruned)
        hist[method] = _train.fit(net, train_split, margin_loss_fn, epochs=rest, checkpoint=ckpt(run),
                                  before_step=getattr(pruner, "before_step", None),
                                  on_epoch_end=chain(pruner.on_epoch_end, tracker() if tracked else None),
                                  desc=f"{method.split(' ')[0]} (seed {seed})", **fit_args)
        nets[method], params[method] = net, pruned
        secs[method] = time.perf_counter() - t0
        return pruned

    rem_params = branch(METHODS[1], "rem", lambda w: LobsterPruner(
        w, val, lam=S.lobster_lambda, decay=S.lobster_decay, tolerance=S.lobster_tolerance, steps=S.search_steps,
        sensitivity=getattr(S, "lobster_sensitivity", None)))
    rem_path = list(hist[METHODS[1]].get("sparsity", [])) or [sparsity(rem_params)]
    if getattr(S, "imp_matched", False):   # magnitude alone, to REM's sparsity after each epoch
        branch(METHODS[2], "imp_matched", lambda w: MatchedPruner(w, rem_path, lam=0.0))
    else:
        branch(METHODS[2], "imp", lambda w: MagnitudeSchedulePruner(w, S.imp_final_sparsity, rest))
    if getattr(S, "ablation", False):      # LOBSTER's shrinkage without its gate, same sparsities
        branch(WEIGHT_DECAY, "wd", lambda w: MatchedPruner(w, rem_path, lam=S.lobster_lambda, decay=S.lobster_decay,
                                                           sensitivity="none"), tracked=False)

    t0 = time.perf_counter()
    snip_net = make_capsnet(S, seed, device)
    snip_params = prunable(snip_net)
    target = sparsity(rem_params)
    masks = snip_masks(snip_net, snip_params, margin_loss_fn, train_split.x[:S.snip_batch],
                       train_split.y[:S.snip_batch], target)
    for (module, name), mask in zip(snip_params, masks):
        set_mask(module, name, mask)
    hist[METHODS[3]] = _train.fit(snip_net, train_split, margin_loss_fn, epochs=S.epochs, checkpoint=ckpt("snip"),
                                  on_epoch_end=tracker(), desc=f"SNIP (seed {seed})", **fit_args)
    nets[METHODS[3]], params[METHODS[3]] = snip_net, snip_params
    secs[METHODS[3]] = time.perf_counter() - t0
    return {"seed": seed, "nets": nets, "params": params, "history": hist, "seconds": secs}


# ----------------------------------------------------------------------------- FC CapsNet

class FCOutput(NamedTuple):
    lengths: torch.Tensor          # (B, J) class-capsule lengths
    capsules: list                 # per layer l = 0..L: (B, N_l, D) capsules (primary first)
    couplings: list                # per routed layer: (B, N_l, N_{l+1}) last-iteration couplings


class FCCapsNet(nn.Module):
    """Multi-layer fully connected DR-CapsNet for parse trees (Renzulli et al., Sec. 4.3.4 and
    App. B.1; chapter 6): ``primary_caps`` primary capsules, ``hidden_layers`` fully connected
    capsule layers of ``hidden_caps`` capsules and ``num_classes`` class capsules, all
    ``caps_dim``-D, dynamic routing between every pair of consecutive layers.

    The primary capsules come from a small convolutional stem (``conv_channels`` 9x9, ReLU;
    9x9 stride 2, ReLU) flattened and mapped linearly to ``primary_caps x caps_dim``, then
    squashed, so they have no spatial meaning (the case of Sec. 3.2.2).

    ``forward(x (B, C, H, W))`` -> :class:`FCOutput`.
    """

    def __init__(self, in_channels: int = 1, image_size: int = 28, conv_channels: int = 256,
                 primary_caps: int = 16, hidden_caps: int = 16, hidden_layers: int = 3, caps_dim: int = 8,
                 num_classes: int = 10, iterations: int = 3, init_std: float = 1.0):
        super().__init__()
        for name, v in [("conv_channels", conv_channels), ("primary_caps", primary_caps),
                        ("hidden_caps", hidden_caps), ("caps_dim", caps_dim), ("num_classes", num_classes),
                        ("iterations", iterations), ("image_size", image_size)]:
            check_positive_int(name, v)
        check_positive_int("hidden_layers", hidden_layers, minimum=0)
        if image_size < 25:
            raise ValueError(f"image_size must be >= 25 for the two 9x9 convolutions; got {image_size}")
        self.in_channels, self.image_size, self.num_classes = in_channels, image_size, num_classes
        self.primary_caps, self.caps_dim = primary_caps, caps_dim
        self.conv1 = nn.Conv2d(in_channels, conv_channels, 9)
        self.conv2 = nn.Conv2d(conv_channels, conv_channels, 9, stride=2)
        side = (image_size - 8 - 9) // 2 + 1
        self.primary = nn.Linear(conv_channels * side * side, primary_caps * caps_dim)
        # Squash maps short vectors to much shorter ones (|v| ~ |s|^2), so a deep stack of
        # capsule layers starts with vanishing capsules unless the votes are large enough at
        # initialization. We normalize the stem's features (no learned scale) and scale the
        # primary projection so primary capsules start near length 0.8 whatever the image.
        self.norm = nn.LayerNorm(self.primary.in_features, elementwise_affine=False)
        nn.init.normal_(self.primary.weight, std=0.7 / math.sqrt(self.primary.in_features))
        sizes = [primary_caps] + [hidden_caps] * hidden_layers + [num_classes]
        self.caps = nn.ModuleList(DenseCaps(a, caps_dim, b, caps_dim, iterations, init_std=init_std)
                                  for a, b in zip(sizes[:-1], sizes[1:]))
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> FCOutput:
        check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
        expected = (self.in_channels, self.image_size, self.image_size)
        if tuple(x.shape[1:]) != expected:
            raise ValueError(f"x must be (B, {expected[0]}, {expected[1]}, {expected[2]}); got {tuple(x.shape)}")
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        u = squash(self.primary(self.norm(h.flatten(1))).view(-1, self.primary_caps, self.caps_dim))
        capsules, couplings = [u], []
        for layer in self.caps:
            u, c = layer(u)
            capsules.append(u)
            couplings.append(c)
        return FCOutput(u.norm(dim=-1), capsules, couplings)


def parse_tree_graph(out: FCOutput, sample: int = 0, threshold: str | float = "uniform"):
    """The parse tree of one sample by backtracking (Sec. 3.2.2; chapter 6) as a networkx DiGraph.

    Start from the predicted class capsule; keep an edge ``i -> j`` from layer ``l`` to an
    already kept capsule ``j`` of layer ``l+1`` when its coupling exceeds ``threshold``
    (``"uniform"``: ``1/|Omega^[l+1]|``, the value of an undecided capsule); continue
    from the kept children. Every capsule is a node (``layer``, ``index``, ``activation`` =
    its length, ``in_tree``); kept edges carry ``weight`` = the coupling.
    """
    import networkx as nx

    G = nx.DiGraph()
    acts = [c[sample].norm(dim=-1).detach().cpu() for c in out.capsules]
    for l, a in enumerate(acts):
        for i, val in enumerate(a.tolist()):
            G.add_node((l, i), layer=l, index=i, activation=val, in_tree=False)
    L = len(acts) - 1
    pred = int(acts[L].argmax())
    G.nodes[(L, pred)]["in_tree"] = True
    frontier = {pred}
    for l in range(L - 1, -1, -1):
        c = out.couplings[l][sample].detach().cpu()                        # (N_l, N_{l+1})
        thr = 1.0 / c.shape[1] if threshold == "uniform" else float(threshold)
        children = set()
        for j in sorted(frontier):
            for i in torch.nonzero(c[:, j] > thr).flatten().tolist():
                G.add_edge((l, i), (l + 1, j), weight=float(c[i, j]))
                children.add(i)
        for i in children:
            G.nodes[(l, i)]["in_tree"] = True
        frontier = children
        if not frontier:
            break
    G.graph["predicted"] = pred
    return G


def draw_parse_tree(G, ax=None, title: str | None = None, cmap: str = "viridis"):
    """Draw a :func:`parse_tree_graph`: layers left to right, node colour = capsule length,
    tree nodes outlined, edge width and opacity = coupling. Returns the Axes."""
    import matplotlib.pyplot as plt
    import networkx as nx

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    layers: dict = {}
    for node, d in G.nodes(data=True):
        layers.setdefault(d["layer"], []).append(node)
    pos = {}
    for l, nodes in layers.items():
        n = len(nodes)
        for node in nodes:
            pos[node] = (l, (n - 1) / 2 - G.nodes[node]["index"])
    nodes = list(G.nodes)
    colors = [G.nodes[n]["activation"] for n in nodes]
    edgecolors = ["black" if G.nodes[n]["in_tree"] else "lightgray" for n in nodes]
    nx.draw_networkx_nodes(G, pos, nodelist=nodes, node_color=colors, cmap=cmap, vmin=0, vmax=1,
                           node_size=60, edgecolors=edgecolors, linewidths=1.0, ax=ax)
    edges = list(G.edges(data=True))
    if edges:
        w = [d["weight"] for _, _, d in edges]
        nx.draw_networkx_edges(G, pos, edgelist=[(a, b) for a, b, _ in edges], width=[0.5 + 3 * x for x in w],
                               alpha=0.7, edge_color="tab:red", arrows=False, ax=ax)
    ax.tick_params(bottom=True, labelbottom=True, left=False, labelleft=False)
    ax.set_xticks(range(len(layers)))
    names = ["primary"] + [f"hidden {k}" for k in range(1, len(layers) - 1)] + ["class"]
    ax.set_xticklabels(names[:len(layers)])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("capsule layer")
    if title:
        ax.set_title(title)
    return ax


def tree_size(out: FCOutput, threshold: str | float = "uniform") -> torch.Tensor:
    """Number of capsules in each sample's backtracked parse tree (the class capsule
    included), ``(B,)``; the same rule as :func:`parse_tree_graph`, batched."""
    lengths = out.lengths
    frontier = F.one_hot(lengths.argmax(dim=1), lengths.shape[1]).bool()      # (B, J)
    size = torch.ones(lengths.shape[0], dtype=torch.long, device=lengths.device)
    for c in reversed(out.couplings):                                          # (B, N_l, N_{l+1})
        thr = 1.0 / c.shape[2] if threshold == "uniform" else float(threshold)
        frontier = ((c > thr) & frontier.unsqueeze(1)).any(dim=2)              # (B, N_l)
        size += frontier.sum(dim=1)
    return size
