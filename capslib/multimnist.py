"""MultiMNIST of Sabour et al. 2017 (section "Segmenting highly overlapping digits"; chapter 2).

Each image overlays two MNIST digits of *different* classes, each shifted by up to ``shift`` pixels
in each direction on a ``size x size`` canvas (28 + 2 * 4 = 36 in the paper), combined pixel by
pixel with a maximum. The network is trained on both labels at once and asked for both: an image
counts as correct when its two longest class capsules are exactly its two classes.

A generated set is stored as a :class:`capslib.data.Split` so that :func:`capslib.train.fit` can
batch it: ``x (N, 3, size, size)`` holds the overlay in channel 0 and the two shifted digits alone
in channels 1 and 2 (the reconstruction targets of the segmentation), and ``y (N,)`` holds the pair
code ``10 * a + b`` of the classes ``a`` (channel 1) and ``b`` (channel 2). :func:`labels` and
:func:`overlay` unpack them. The loss (:func:`loss`) returns, as its scores, a one-hot vector over
the 100 pair codes of the predicted *unordered* pair, so that ``fit``'s training accuracy is the
fraction of images whose two labels are both right.
"""
from __future__ import annotations

import torch

from .checks import check_positive_int, check_tensor
from .data import Split
from .ops import margin_loss

SIZE = 36       # the paper's canvas: a 28 x 28 digit shifted by up to 4 px each way
SHIFT = 4
CLASSES = 10


def _place(images: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, size: int) -> torch.Tensor:
    """``images (N, 1, h, w)`` centred on a ``size`` canvas and moved by integer ``dy, dx (N,)``."""
    N, _, h, w = images.shape
    top, left = (size - h) // 2, (size - w) // 2
    canvas = images.new_zeros(N, 1, size, size)
    canvas[:, :, top:top + h, left:left + w] = images
    grid = torch.arange(size, device=images.device)
    rows = grid[None, :] - dy[:, None]          # canvas row r shows source row r - dy
    cols = grid[None, :] - dx[:, None]
    valid = ((rows >= 0) & (rows < size))[:, :, None] & ((cols >= 0) & (cols < size))[:, None, :]
    n = torch.arange(N, device=images.device)[:, None, None]
    out = canvas[n, 0, rows.clamp(0, size - 1)[:, :, None], cols.clamp(0, size - 1)[:, None, :]]
    return (out * valid).unsqueeze(1)


def generate(source: Split, n: int, seed: int = 0, shift: int = SHIFT, size: int = SIZE) -> Split:
    """``n`` MultiMNIST images drawn from the digits of ``source`` with generator ``seed``: two digits
    of different classes, each shifted by integers drawn uniformly from ``[-shift, shift]`` in each
    direction, overlaid with a pixelwise maximum. See the module's docstring for the layout."""
    check_positive_int("n", n)
    if not isinstance(shift, int) or shift < 0:
        raise ValueError(f"shift must be an int >= 0; got {shift!r}")
    h = source.x.shape[-1]
    if size < h + 2 * shift:
        raise ValueError(f"size must be at least {h + 2 * shift} (digit {h} px plus 2 x shift); got {size}")
    if source.x.shape[1] != 1:
        raise ValueError(f"source must hold one-channel digits (N, 1, H, W); got {tuple(source.x.shape)}")
    if int(source.y.unique().numel()) < 2:
        raise ValueError("source must hold digits of at least two classes")
    g = torch.Generator().manual_seed(seed)
    N = len(source)
    first = torch.randint(N, (n,), generator=g)
    second = torch.randint(N, (n,), generator=g)
    ys = source.y.cpu()
    same = ys[first] == ys[second]
    while bool(same.any()):                       # redraw the second digit until the classes differ
        second[same] = torch.randint(N, (int(same.sum()),), generator=g)
        same = ys[first] == ys[second]
    shifts = torch.randint(-shift, shift + 1, (4, n), generator=g)
    dev = source.x.device
    a = _place(source.x[first.to(dev)], shifts[0].to(dev), shifts[1].to(dev), size)
    b = _place(source.x[second.to(dev)], shifts[2].to(dev), shifts[3].to(dev), size)
    x = torch.cat([torch.maximum(a, b), a, b], dim=1)
    y = (CLASSES * ys[first] + ys[second]).to(source.y.device)
    return Split(x, y)


class PairShift:
    """The paper's pairs drawn anew during training, as an ``augment`` of :func:`capslib.train.fit`.

    Give ``fit`` a set made by :func:`generate` with ``shift=0`` (both digits centred on the canvas);
    every batch then has each of its two digits moved by its own integer offsets, drawn uniformly from
    ``[-shift, shift]`` along each axis (zero fill, :func:`capslib.data.random_shift`), and the overlay
    rebuilt as their pixelwise maximum. The pairings stay those of the set; their relative positions
    are new every time a pair is seen, as when the paper generated its training pairs on the fly.
    Seeded; the generator is made on the first batch's device."""

    def __init__(self, shift: int = SHIFT, seed: int = 0):
        if not isinstance(shift, int) or shift < 0:
            raise ValueError(f"shift must be an int >= 0; got {shift!r}")
        self.shift, self.seed = shift, int(seed)
        self._gen: torch.Generator | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from .data import random_shift

        overlay(x)   # checks that x is a generated batch (B, 3, H, W)
        if self._gen is None or self._gen.device != x.device:
            self._gen = torch.Generator(device=x.device).manual_seed(self.seed)
        a = random_shift(x[:, 1:2], self.shift, self._gen)
        b = random_shift(x[:, 2:3], self.shift, self._gen)
        return torch.cat([torch.maximum(a, b), a, b], dim=1)

    def __repr__(self) -> str:
        return f"PairShift(shift={self.shift}, seed={self.seed})"


@torch.no_grad()
def reconstruction_distances(model, split: Split, batch_size: int = 500) -> tuple[torch.Tensor, ...]:
    """Each digit of each pair (first digits, then second, batch by batch) rebuilt from its own class capsule:
    squared error to itself, to the other digit of its pair, and its own sum of squares (three ``(2 N,)``)."""
    was, own, other, energy = model.training, [], [], []
    model.eval()
    try:
        for i in range(0, len(split), batch_size):
            xb, yb = split.x[i:i + batch_size], split.y[i:i + batch_size]
            v, _ = model.encode(overlay(xb))
            for k, label in enumerate(labels(yb).T):
                rec = model.decode(v, label).reshape(len(xb), 1, *xb.shape[-2:]).float()
                mine, theirs = xb[:, 1 + k:2 + k].float(), xb[:, 2 - k:3 - k].float()
                for out, d in ((own, rec - mine), (other, rec - theirs), (energy, mine)):
                    out.append((d ** 2).flatten(1).sum(1))
    finally:
        model.train(was)
    return torch.cat(own), torch.cat(other), torch.cat(energy)


def segmentation(model, split: Split, batch_size: int = 500) -> float:
    """The share of digits rebuilt nearer (squared error) to themselves than to the other digit of their pair: about
    1/2 when the decoder draws one blend for both classes, 1 when it separates every pair (Sabour's Fig. 5 as a number)."""
    own, other, _ = reconstruction_distances(model, split, batch_size)
    return float((own < other).double().mean())


def labels(y: torch.Tensor) -> torch.Tensor:
    """Pair codes ``(B,)`` -> the two classes ``(B, 2)`` (first digit, second digit)."""
    check_tensor("y", y, dims=1)
    return torch.stack([y // CLASSES, y % CLASSES], dim=1)


def overlay(x: torch.Tensor) -> torch.Tensor:
    """The network's input: channel 0 of a generated batch, ``(B, 1, size, size)``."""
    check_tensor("x", x, dims=4, floating=True, shape_doc="(B, 3, H, W)")
    if x.shape[1] != 3:
        raise ValueError(f"x must be a MultiMNIST batch (B, 3, H, W); got {tuple(x.shape)}")
    return x[:, :1]


def top2_pairs(lengths: torch.Tensor) -> torch.Tensor:
    """The two longest class capsules of each image as an unordered pair code ``10 * min + max``."""
    top = lengths.topk(2, dim=1).indices
    return CLASSES * top.min(dim=1).values + top.max(dim=1).values


def both_right(lengths: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per image ``(B,)`` bool: its two longest class capsules (``lengths (B, classes)``) are exactly its two
    classes (pair codes ``y (B,)``), in either order."""
    ab = labels(y)
    return top2_pairs(lengths) == CLASSES * ab.min(dim=1).values + ab.max(dim=1).values


def loss(model, x: torch.Tensor, y: torch.Tensor, recon_weight: float = 0.0005):
    """``loss_fn`` for :func:`capslib.train.fit`: the margin loss with both classes present plus ``recon_weight`` x
    the squared error of reconstructing each digit alone from its own class capsule (the paper's
    segmentation). Returns ``(loss, scores)``; ``scores (B, 100)`` is one-hot on ``y``'s own code when
    the two longest capsules are the image's two classes (in either order) and on the predicted
    pair's code otherwise, so that ``fit``'s training accuracy (``scores.argmax == y``) is the
    fraction of images with both labels right."""
    v, _ = model.encode(overlay(x))
    lengths = v.norm(dim=-1)
    ab = labels(y)
    total = margin_loss(lengths.float(), ab)
    if recon_weight:
        for k in range(2):
            rec = model.decode(v, ab[:, k])
            total = total + recon_weight * ((rec.float() - x[:, 1 + k:2 + k].float()) ** 2).flatten(1).sum(1).mean()
    code = torch.where(both_right(lengths.detach(), y), y, top2_pairs(lengths.detach()))
    scores = torch.nn.functional.one_hot(code, CLASSES * CLASSES).to(lengths.dtype)
    return total, scores


@torch.no_grad()
def accuracy(model, split: Split, batch_size: int = 500) -> float:
    """The fraction of images whose two longest class capsules are exactly their two classes."""
    was = model.training
    model.eval()
    right = 0
    try:
        for i in range(0, len(split), batch_size):
            xb, yb = split.x[i:i + batch_size], split.y[i:i + batch_size]
            v, _ = model.encode(overlay(xb))
            right += int(both_right(v.norm(dim=-1), yb).sum())
    finally:
        model.train(was)
    return right / len(split)
