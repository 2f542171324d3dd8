"""``capslib.book.setup()``: seed everything, pick the device, print one line."""
from __future__ import annotations

import base64
import ctypes
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..engine import switches
from . import profiles

_STATE: dict = {}


@dataclass(frozen=True)
class Session:
    profile: str
    device: torch.device
    seed: int
    started: float

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def env_int(name: str, default: int | None, minimum: int = 0) -> int | None:
    """``$name`` as an int (``default`` when unset or empty); a clear error otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value}")
    return value


# mallopt(3) parameters of glibc's malloc
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20   # blocks up to 32 MiB (glibc's largest allowed threshold) come from the heap
TRIM_THRESHOLD = 1 << 30    # freed heap memory up to 1 GiB stays with the process
TOP_PAD = 64 << 20          # and the heap grows 64 MiB at a time


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the kernel.

    A training step on the CPU allocates and frees the same large tensors every step (a
    routing pass of chapter 5's network: several of 15 MB). With glibc's defaults many of
    them go back to the kernel when freed and return as fresh pages, one page fault per 4 KiB
    on first touch. Measured on 2 cores: 4,100-6,000 page faults per training step of chapter 2's
    ``ci`` CapsNet and 12,000-13,000 per step of chapter 5's ``ci`` EM network with the defaults,
    fewer than 200 with these settings; either step took 8-17 % less time over repeated measurements.
    Values are unchanged: only where memory comes from.
    Returns whether it applied (Linux with glibc only)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # pragma: no cover
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))


def cpu_name() -> str:
    """The processor: its model name and the vector instructions torch's CPU kernels use here.

    Two processors can give different bits for the same computation (other kernels, other
    summation orders), and a training amplifies the difference: the same seed then ends at
    another accuracy. :func:`setup` prints it; the spread runs record it (``capslib.tools.spread``)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()}, {torch.backends.cpu.get_cpu_capability()} kernels"


def cpu_label(threads: int | None = None) -> str:
    """``"<cpu_name()>, N threads"`` (``threads`` defaults to torch's): the CPU as :func:`setup` prints it
    and :func:`capslib.book.results.record` stores it."""
    n = torch.get_num_threads() if threads is None else threads
    return f"{cpu_name()}, {n} thread{'' if n == 1 else 's'}"


def whole_tables() -> None:
    """Let pandas show every row, column and cell of a table in full: a reader of the published page
    cannot scroll a truncated DataFrame, and a note cut to "…" loses its end."""
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover
        return
    for option in ("display.max_rows", "display.max_columns", "display.max_colwidth"):
        pd.set_option(option, None)


def retina_figures() -> bool:
    """In a Jupyter kernel, show matplotlib figures as retina PNGs: drawn at twice the figure's dpi,
    with the figure's size in CSS pixels in the output's metadata (myst-nb writes it as the image's
    width), so the published page shows them at the same size, sharp on high-density screens and
    still legible where the column is narrower than the figure. Returns whether it applied."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return False
    shell = get_ipython()
    if shell is None or "IPKernelApp" not in getattr(shell, "config", {}):
        return False
    from matplotlib_inline.backend_inline import set_matplotlib_formats

    set_matplotlib_formats("retina")
    from matplotlib.figure import Figure

    png = shell.display_formatter.formatters["image/png"]
    retina = png.lookup_by_type(Figure)
    if not getattr(retina, "measures_text", False):
        png.for_type(Figure, _measuring(retina))
    return True


def _measuring(retina):
    """The PNG formatter ``retina`` with, in the output's metadata, how large the figure's smallest
    text appears in the book's column (``capsbook``: see :func:`capslib.book.viz.text_on_page`);
    ``tests/test_outputs.py`` holds every committed figure to ``viz.MIN_TEXT_PX``. A figure too wide to read
    in a phone's column also gets its phone drawing (:mod:`capslib.book.reflow`), written beside the players'
    frames; its path and smallest text go into the same metadata (``narrow``, ``narrow_px``), and the book
    shows it on narrow screens. ``alt`` is the figure's text alternative (:func:`capslib.book.viz.alt_text`),
    which :mod:`capslib.tools.sphinx_figures` gives its image in the book."""
    from . import reflow, viz, widgets

    def png(fig):
        info = {**viz.text_on_page(fig), "alt": viz.alt_text(fig)}
        phone = reflow.narrow_png(fig) if widgets.phone_figures() else None
        if reflow.is_diagram(fig):
            info = {**info, "diagram": True}     # not re-laid for a phone (see reflow.is_diagram)
        out = retina(fig)
        if out is None:
            return None
        data, meta = out if isinstance(out, tuple) else (out, {})
        if phone is not None:
            raw = base64.b64decode(data) if isinstance(data, str) else data   # IPython hands the PNG as base64
            path = widgets.write_narrow(raw, phone[0])
            if path is not None:
                info = {**info, "narrow": path, "narrow_px": phone[1]["smallest_px"]}
        return data, {**(meta or {}), "capsbook": info}

    png.measures_text = True
    return png


def setup(seed: int | None = None, device: str | torch.device | None = None, quiet: bool = False) -> Session:
    """Seed Python, NumPy and torch; choose the device; print profile, device and data sizes.

    Call it in the first code cell of every chapter so the reader sees at which
    scale the outputs were produced. ``seed`` defaults to ``$CAPSBOOK_SEED`` or 0 (the
    spread runs, ``make spread``, execute the chapters under other seeds this way);
    ``$CAPSBOOK_THREADS`` fixes torch's CPU thread count (``make test`` sets 1). On Linux it
    also keeps freed memory for reuse (:func:`keep_freed_memory`).
    """
    profile = profiles.current()
    dev = torch.device(device) if device is not None else default_device()
    if seed is None:
        seed = env_int("CAPSBOOK_SEED", 0)
    threads = env_int("CAPSBOOK_THREADS", None, minimum=1)
    if threads is not None:
        torch.set_num_threads(threads)
    seed_everything(seed)
    keep_freed_memory()
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        name = torch.cuda.get_device_name(dev)
    else:
        name = cpu_label()
    retina_figures()
    whole_tables()
    sess = Session(profile=profile, device=dev, seed=seed, started=time.time())
    _STATE["session"] = sess
    switches.set_run_defaults(dev, seed, sess.started)
    if not quiet:
        from ..data import describe
        print(f"capslib | profile={profile} | device={dev.type} ({name}) | torch {torch.__version__} | "
              f"seed={seed} | data: {describe(profile)}")
    return sess


def current_session() -> Session:
    """The session of the last :func:`setup` call (set up quietly if there was none)."""
    if "session" not in _STATE:
        setup(quiet=True)
    return _STATE["session"]


def device() -> torch.device:
    return current_session().device
