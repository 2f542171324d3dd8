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
  :func:`miller_madow_entropy`, :func:`count_parse_trees`, :func:`parse_tree_dictionary`,
  :class:`QuantizedRouting`;
* the network without decoder (App. C.2): :func:`margin_loss_fn`, :func:`predict_lengths`;
* measurements: :func:`last_couplings`, :func:`level_sweep`, :func:`saliency_maps` (Eq. 16);
* the multi-layer fully connected DR-CapsNet :class:`FCCapsNet` and the size of its backtracked
  parse trees, :func:`tree_size` (edges above :func:`tree_threshold`).

The pruning REM trains with (masks, LOBSTER, magnitude pruning to a schedule, SNIP) is
:mod:`capslib.pruning`.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .checks import check_positive_int, check_tensor
from .layers import DenseCaps
from .ops import margin_loss, squash
from .routing import dynamic_routing


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


def bootstrap_entropy(codes: torch.Tensor, predicted: torch.Tensor, num_classes: int,
                      index: torch.Tensor) -> torch.Tensor:
    """The mean plug-in entropy of :func:`parse_tree_entropy` on resamples of the samples (chapter 6).

    ``index (B, N)`` holds, per resample, the rows of ``codes``/``predicted`` it draws (with replacement,
    e.g. ``torch.randint(N, (B, N))``); giving two networks the same ``index`` pairs their resamples
    digit by digit. Returns a float64 ``(B,)``: each resample's class-mean entropy in bits, the same
    numbers as :func:`parse_tree_entropy` on ``codes[index[b]]`` (keys are numbered once; each resample
    only counts them). Its spread measures how much one run's entropy owes to the particular test digits;
    its mean sits below the estimate where keys are rare, since a resample repeats digits.
    """
    _check_codes(codes, predicted, num_classes)
    if index.dim() != 2 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index must be an integer (B, N) tensor of row numbers; got {tuple(index.shape)} {index.dtype}")
    N = codes.shape[0]
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= N):
        raise ValueError(f"index must hold row numbers in [0, {N}); got [{int(index.min())}, {int(index.max())}]")
    rows = torch.cat([predicted.long().unsqueeze(1), codes.long()], dim=1)
    keys, key_of = torch.unique(rows, dim=0, return_inverse=True)      # key_of: each sample's key number
    key_class = keys[:, 0].to(index.device)
    B, U = index.shape[0], keys.shape[0]
    drawn = key_of.to(index.device)[index]                              # (B, n) key numbers
    counts = torch.zeros(B, U, dtype=torch.float64, device=index.device).scatter_add_(
        1, drawn, torch.ones_like(drawn, dtype=torch.float64))
    n_j = torch.zeros(B, num_classes, dtype=torch.float64, device=index.device).index_add_(1, key_class, counts)
    p = counts / n_j[:, key_class].clamp_min(1)
    h = torch.where(counts > 0, -p * torch.log2(p.clamp_min(1e-300)), torch.zeros_like(p))
    per_class = torch.zeros(B, num_classes, dtype=torch.float64, device=index.device).index_add_(1, key_class, h)
    return per_class.mean(dim=1)


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


# ----------------------------------------------------------------------------- the network without decoder

def margin_loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """``loss_fn`` for :func:`capslib.train.fit`: margin loss only (no decoder, App. C.2)."""
    lengths = _lengths(model, x)
    return margin_loss(lengths, y), lengths


def predict_lengths(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``predict`` for :func:`capslib.train.evaluate`: class-capsule lengths ``(B, J)``."""
    return _lengths(model, x)


def _lengths(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "encode") and hasattr(model, "primary"):
        v, _ = model.encode(x)          # CapsNet: skip the decoder
        return v.norm(dim=-1)
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out[0]


# ----------------------------------------------------------------------------- measurements

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


def tree_threshold(parents: int, threshold: str | float = "uniform", levels: int | None = None) -> float:
    """The coupling an edge into a layer of ``parents`` capsules must exceed to join a parse tree.

    ``"uniform"`` is ``1/parents``, the coupling of an undecided capsule (the paper's threshold,
    its App. C.4); with ``levels`` (couplings quantized into ``K`` levels, Eq. 13) it is that value
    quantized, ``q_K(1/parents)``: a quantized coupling is compared with the level an undecided one
    lands on. Without it, ``q_11(1/16) = 0.1 > 1/16`` and every undecided coupling would join.
    A number is used as given."""
    check_positive_int("parents", parents)
    if threshold != "uniform":
        return float(threshold)
    if levels is None:
        return 1.0 / parents
    check_positive_int("levels", levels, minimum=2)
    return round((levels - 1) / parents) / (levels - 1)


def tree_size(out: FCOutput, threshold: str | float = "uniform", levels: int | None = None) -> torch.Tensor:
    """Number of capsules in each sample's parse tree (the class capsule included), ``(B,)``, by
    backtracking (Sec. 3.2.2): start from the predicted class capsule and keep a capsule ``i`` of
    layer ``l`` when its coupling to a kept capsule of layer ``l+1`` exceeds :func:`tree_threshold`
    (``"uniform"``: ``1/|Omega^[l+1]|``, the coupling of an undecided capsule, quantized into
    ``levels`` levels when the couplings are). Chapter 6 draws single trees by the same rule
    (``capslib.book.ch06.parse_tree_graph``)."""
    lengths = out.lengths
    frontier = F.one_hot(lengths.argmax(dim=1), lengths.shape[1]).bool()      # (B, J)
    size = torch.ones(lengths.shape[0], dtype=torch.long, device=lengths.device)
    for c in reversed(out.couplings):                                          # (B, N_l, N_{l+1})
        thr = tree_threshold(c.shape[2], threshold, levels)
        frontier = ((c > thr) & frontier.unsqueeze(1)).any(dim=2)              # (B, N_l)
        size += frontier.sum(dim=1)
    return size
