"""Figures shared by the chapters (matplotlib + seaborn). Each returns its ``Figure``."""
from __future__ import annotations

import math
import re

import matplotlib.pyplot as plt
import numpy as np
import torch

# The page a figure is drawn for. At a 1280-px window sphinx-book-theme's text column is 688 CSS px
# wide; a figure wider than that is scaled down to it, its text with it. The smallest text a reader
# is asked to read there is 9 pt, which CSS draws 12 px high (1 pt = 4/3 px). A figure at
# ``FIGURE_DPI`` draws an ``s``-pt font ``s * FIGURE_DPI / 72`` px high before any scaling.
COLUMN_PX = 688
MIN_TEXT_PX = 12.0
FIGURE_DPI = 100
PAD_INCHES = 0.1          # savefig's pad around the tight bounding box (the inline backend's setting)
COLUMN_IN = COLUMN_PX / FIGURE_DPI   # a figure this wide (in inches) fills the column unscaled
# an equation's internal label (ch2-softmax): readers see equation numbers, never these
INTERNAL_LABEL = re.compile(r"\bch\d+-[a-z]")


def text_on_page(fig, dpi: float = FIGURE_DPI, column_px: float = COLUMN_PX) -> dict:
    """How large the figure's smallest text appears in the book's column.

    The figure is drawn once as the inline backend saves it (tight bounding box); every text that
    is actually drawn (visible, not empty: titles, labels, tick labels, legends, annotations) is
    collected. Returns ``width_px`` (the figure's width on the page before scaling), ``scale``
    (``min(1, column_px / width_px)``), ``smallest_px`` (the smallest drawn text's height on the
    page in CSS px, None for a figure without text) and ``smallest_text`` (that text); and
    ``internal_labels``, the texts that name an equation by its internal label, where any do."""
    from matplotlib.text import Text

    if not dpi > 0 or not column_px > 0:
        raise ValueError(f"dpi and column_px must be positive; got dpi={dpi}, column_px={column_px}")
    drawn: list = []
    original = Text.draw

    def recording(self, renderer):
        if self.get_visible() and self.get_text().strip():
            drawn.append(self)
        return original(self, renderer)

    if not hasattr(fig.canvas, "get_renderer"):   # a bare Figure(): draw it with Agg, as the inline backend does
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    Text.draw = recording
    try:
        fig.canvas.draw()
    finally:
        Text.draw = original
    renderer = fig.canvas.get_renderer()
    box = fig.get_tightbbox(renderer)
    width_px = (box.width + 2 * PAD_INCHES) * dpi
    scale = min(1.0, column_px / width_px)
    info = {"width_px": round(float(width_px), 1), "scale": round(float(scale), 4), "smallest_px": None, "smallest_text": None}
    labelled = [t.get_text()[:60] for t in drawn if INTERNAL_LABEL.search(t.get_text())]
    if labelled:
        info["internal_labels"] = labelled
    if drawn:
        small = min(drawn, key=lambda t: t.get_fontsize())
        info["smallest_px"] = round(float(small.get_fontsize() * dpi / 72 * scale), 2)
        info["smallest_text"] = small.get_text()[:60]
    return info


def _np(t):
    return t.detach().float().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def tile(images, ncol: int, pad: int = 1, fill: float = 1.0) -> np.ndarray:
    """Images ``(N, C, H, W)`` -> one mosaic ``(rows*(H+pad), ncol*(W+pad)[, C])`` for a single imshow."""
    a = _np(images)
    N, C, H, W = a.shape
    rows = math.ceil(N / ncol)
    out = np.full((rows * (H + pad) - pad, ncol * (W + pad) - pad, C), fill, dtype=np.float32)
    for k in range(N):
        r, c = divmod(k, ncol)
        out[r * (H + pad):r * (H + pad) + H, c * (W + pad):c * (W + pad) + W] = np.transpose(a[k], (1, 2, 0))
    return out[..., 0] if C == 1 else out


def image_grid(images, nrow: int | None = None, titles=None, title: str | None = None, cmap: str = "gray",
               size: float = 1.1, vmin: float | None = 0.0, vmax: float | None = 1.0):
    """Show images ``(N, C, H, W)`` or ``(R, K, C, H, W)`` (a grid of R rows of K).

    Without ``titles`` the grid is one tiled image (fast for hundreds of digits);
    with ``titles`` each image gets its own small axis and caption. Each image is ``size`` inches
    wide, less where the row would be wider than the column (its title stays legible there)."""
    a = _np(images)
    if a.ndim == 5:
        rows, ncol = a.shape[:2]
        a = a.reshape(rows * ncol, *a.shape[2:])
    else:
        ncol = nrow or min(len(a), 10)
        rows = math.ceil(len(a) / ncol)
    size = min(size, (COLUMN_IN - 0.2) / ncol)
    if titles is None:
        fig, ax = plt.subplots(figsize=(size * ncol, size * rows + (0.4 if title else 0)))
        ax.imshow(tile(a, ncol, fill=vmax if vmax is not None else float(a.max())), cmap=cmap, vmin=vmin, vmax=vmax)
        ax.axis("off")
    else:
        fig, axes = plt.subplots(rows, ncol, figsize=(size * ncol, size * rows), squeeze=False)
        for k, ax in enumerate(axes.flat):
            ax.axis("off")
            if k < len(a):
                img = a[k]
                img = img[0] if img.shape[0] == 1 else np.transpose(img, (1, 2, 0))
                ax.imshow(img, cmap=cmap, vmin=vmin, vmax=vmax)
                if k < len(titles):
                    ax.set_title(str(titles[k]), fontsize=10)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


MAX_TICKS = 8  # labelled rows per heatmap axis (more overlap at the book's column width)


def heatmap_grid(mats, titles, xlabel: str, ylabel: str, cbar_label: str, vmax: float | None = 1.0,
                 per_row: int = 3, suptitle: str | None = None, panel_width: float = 1.95,
                 panel_height: float = 3.6, xticklabels="auto", vmin: float = 0.0, cmap: str = "viridis"):
    """Heatmaps of 2-D arrays, at most ``per_row`` to a row (legible at the book's column width),
    on one colour scale from ``vmin`` to ``vmax`` (the largest value if None) with one colour bar
    (a diverging ``cmap`` such as "RdBu_r" with ``vmin = -vmax`` shows deviations from a value)."""
    import math

    import seaborn as sns
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    mats = [_np(m) for m in mats]
    if len(mats) != len(titles):
        raise ValueError(f"titles must have one entry per matrix ({len(mats)}); got {len(titles)}")
    if not isinstance(per_row, int) or per_row < 1:
        raise ValueError(f"per_row must be a positive integer; got {per_row!r}")
    top = vmax if vmax is not None else max(float(m.max()) for m in mats)
    if not top > vmin:
        raise ValueError(f"the colour scale needs vmax > vmin; got vmin={vmin}, vmax={top}")
    cols = min(per_row, len(mats))
    rows = math.ceil(len(mats) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(panel_width * cols + 1.2, panel_height * rows + (0.4 if suptitle else 0)),
                             squeeze=False, layout="constrained")
    for k, ax in enumerate(axes.flat):
        if k >= len(mats):
            ax.set_visible(False)
            continue
        # every n-th row labelled, upright, so that at most MAX_TICKS labels share an axis
        ystep = max(1, math.ceil(mats[k].shape[0] / MAX_TICKS))
        sns.heatmap(mats[k], ax=ax, vmin=vmin, vmax=top, cmap=cmap, cbar=False, xticklabels=xticklabels,
                    yticklabels=ystep)
        ax.tick_params(axis="y", labelrotation=0)
        ax.set_title(titles[k], fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel if k % cols == 0 else "")
    fig.colorbar(ScalarMappable(Normalize(vmin, top), cmap), ax=axes, label=cbar_label, shrink=0.85)
    if suptitle:
        fig.suptitle(suptitle)
    return fig


def coupling_heatmaps(cs, title: str = "couplings c_ij", xlabel: str = "parent capsule j",
                      ylabel: str = "input capsule i", max_rows: int = 40, per_row: int = 3):
    """One heatmap per routing iteration of the couplings ``(I, J)`` it uses (the list from
    ``routing_trace``: iteration 1 uses the uniform start)."""
    return heatmap_grid([_np(c)[:max_rows] for c in cs], [f"used in iteration {t + 1}" for t in range(len(cs))],
                        xlabel, ylabel, "coupling", vmax=1.0, per_row=per_row, suptitle=title)


#: the words a reader sees beside a history's standard keys (any other key is shown with its underscores as spaces)
HISTORY_LABELS = {"loss": "training loss", "train_acc": "training accuracy", "val_acc": "validation accuracy"}


def history_plot(histories: dict, keys=("loss", "val_acc"), title: str | None = None):
    """Curves per epoch for several runs: ``{run name: history}`` -> one panel per key, labelled in words
    (:data:`HISTORY_LABELS`)."""
    import math

    cols = min(2, len(keys))                     # two panels to a row: legible at the column width
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.5 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        for name, h in histories.items():
            if key in h and len(h[key]):
                ax.plot(np.arange(1, len(h[key]) + 1), h[key], marker="o", ms=3, label=name)
        ax.set_xlabel("epoch")
        ax.set_ylabel(HISTORY_LABELS.get(key, key.replace("_", " ")))
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- text alternatives

# TeX commands of the figures' labels, as a screen reader should hear them
_TEX_WORDS = {
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "varepsilon": "ε", "zeta": "ζ",
    "eta": "η", "theta": "θ", "kappa": "κ", "lambda": "λ", "mu": "μ", "nu": "ν", "xi": "ξ", "pi": "π",
    "rho": "ρ", "sigma": "σ", "tau": "τ", "phi": "φ", "varphi": "φ", "chi": "χ", "psi": "ψ", "omega": "ω",
    "Gamma": "Γ", "Delta": "Δ", "Theta": "Θ", "Lambda": "Λ", "Sigma": "Σ", "Phi": "Φ", "Psi": "Ψ", "Omega": "Ω",
    "sum": "Σ", "prod": "Π", "cdot": "·", "times": "×", "le": "≤", "leq": "≤", "ge": "≥", "geq": "≥",
    "neq": "≠", "ne": "≠", "approx": "≈", "to": "→", "rightarrow": "→", "leftarrow": "←", "infty": "∞",
    "pm": "±", "partial": "∂", "nabla": "∇", "in": "∈", "|": "‖", "Vert": "‖", "vert": "|", "%": "%", "log": "log",
    "ln": "ln",
    "exp": "exp", "max": "max", "min": "min", "arg": "arg", "operatorname": "", "mathrm": "", "mathbf": "",
    "mathit": "", "boldsymbol": "", "mathcal": "", "text": "", "textrm": "", "left": "", "right": "", "big": "",
    "Big": "", "bigl": "", "bigr": "", ",": " ", ";": " ", "!": "", "quad": " ", "qquad": " ",
}
_TEX_ACCENTS = {"hat": "\u0302", "bar": "\u0304", "tilde": "\u0303", "vec": "\u20d7", "dot": "\u0307"}
_PLURAL = {"an image": "images", "a plot": "plots"}
_TEX_COMMAND = re.compile(r"\\([A-Za-z]+|[|%,;!])")


def plain_text(label: str) -> str:
    """A figure label in words and Unicode, as a screen reader should read it: mathtext's ``$...$`` spans
    turned from TeX into Unicode (``$\\|\\mathbf v_j\\|$`` -> ``‖v_j‖``, ``$\\kappa$`` -> ``κ``), the rest kept."""
    def maths(m: re.Match) -> str:
        s = re.sub(r"\\(?:mathbf|mathrm|mathit|boldsymbol|mathcal|operatorname|textrm|text)\s*(\{[^{}]*\}|\\?[A-Za-z])",
                   lambda f: f.group(1).strip("{}"), m.group(1))
        s = re.sub(r"\\(hat|bar|tilde|vec|dot)\s*\{?\s*\\?([A-Za-z])\}?",
                   lambda a: _TEX_WORDS.get(a.group(2), a.group(2)) + _TEX_ACCENTS[a.group(1)], s)
        s = re.sub(r"\\mathbb\s*\{?([A-Za-z0-9])\}?",
                   lambda a: {"1": "𝟙", "H": "ℍ", "E": "𝔼", "R": "ℝ", "N": "ℕ"}.get(a.group(1), a.group(1)), s)
        s = re.sub(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}",
                   lambda f: "/".join(t if re.fullmatch(r"\w+", t) else f"({t})" for t in f.groups()), s)
        s = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"√(\1)", s)
        s = _TEX_COMMAND.sub(lambda c: _TEX_WORDS.get(c.group(1), c.group(1)), s)
        s = re.sub(r"([_^])\{([^{}]*)\}", r"\1\2", s)
        s = s.replace("{", "").replace("}", "").replace("~", " ")
        return re.sub(r"\s+", " ", s).strip()

    import unicodedata

    text = re.sub(r"(?<!\\)\$(.+?)(?<!\\)\$", maths, str(label)).replace("\\$", "$")
    return unicodedata.normalize("NFC", re.sub(r"\s+", " ", text).strip())   # u + combining hat -> û


def alt_text(fig, max_panels: int = 6) -> str:
    """A text alternative for ``fig`` (the ``alt`` of its image in the book), built from what the figure
    says of itself: its title, then each panel's title and what its axes show (``y against x``), the
    colour bars' labels, a panel of an image without axis labels as an image; consecutive panels that read
    alike are said once with their range, and after ``max_panels`` such groups only the range of the rest. A
    figure whose panels say nothing of themselves (a diagram) is read by the words placed on it."""
    title = fig.get_suptitle()
    panels, bars = [], []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        if ax.get_label() == "<colorbar>":
            label = ax.get_ylabel() or ax.get_xlabel()
            if label.strip():
                bars.append(plain_text(label))
            continue
        parts = []
        head = plain_text(ax.get_title() or ax.get_title("left") or ax.get_title("right"))
        x, y = plain_text(ax.get_xlabel()), plain_text(ax.get_ylabel())
        if y and x:
            parts.append(f"{y} against {x}")
        elif y or x:
            parts.append(y or x)
        elif ax.images:
            parts.append("an image")
        elif not head and (ax.lines or ax.patches or ax.collections):
            parts.append("a plot")                    # a panel that shares its neighbours' labels
        if not (head or parts):
            continue
        panels.append(f"{head}: {'; '.join(parts)}" if head and parts else head or parts[0])
    words = []
    if title.strip():
        words.append(plain_text(title) + ".")
    if len(panels) == 1:
        words.append(panels[0][:1].upper() + panels[0][1:] + ".")
    elif panels:
        runs: list[list] = []                       # consecutive panels that read alike, said once
        for k, p in enumerate(panels, start=1):
            if runs and runs[-1][2] == p:
                runs[-1][1] = k
            else:
                runs.append([k, k, p])
        shown = "; ".join(f"({a}) {p}" if a == b else f"({a}-{b}) {_PLURAL.get(p, p)}"
                          for a, b, p in runs[:max_panels])
        rest = runs[max_panels:]
        more = f"; and panels {rest[0][0]}-{rest[-1][1]}" if rest else ""
        words.append(f"{len(panels)} panels: {shown}{more}.")
    if bars:
        words.append("Colour scale: " + "; ".join(dict.fromkeys(bars)) + ".")
    if not panels:                                  # a diagram: the words placed on it
        placed = [plain_text(t.get_text()) for t in [*fig.texts, *(t for ax in fig.axes for t in ax.texts)]
                  if t.get_visible() and t.get_text().strip() and t.get_text() != title]
        if placed:
            words.append("A diagram labelled: " + "; ".join(dict.fromkeys(placed)) + ".")
    return " ".join(words) or "A figure without titles or axis labels."
