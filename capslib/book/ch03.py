"""Chapter 3 (soft-routing gradients): its sizes per profile and its figures; the network, its
gradients and training live in the library, :mod:`capslib.soft_routing`."""
from __future__ import annotations

import torch

from . import profiles
from .viz import heatmap_grid

CHAPTER = "03_soft_routing_gradients"

# Chapter 3's sizes. The slides give no hyper-parameters, so `full` is this book's
# choice on the full datasets the slides show results for (MNIST here; CIFAR-10
# where torchvision's files are on disk).
profiles.register(
    CHAPTER,
    ci=dict(dataset="embedded", routes=4, epochs=20, batch_size=50, lr=0.003, init_std=0.01,
            routing_init_std=0.3, compare_routes=(1, 2, 4, 8), compare_epochs=20, compare_seeds=3,
            match_steps=50, scaling_samples=1000, cifar=False,
            ablation_images=1000, ablation_epochs=6, ablation_seeds=3),
    full=dict(dataset="mnist", routes=4, epochs=60, batch_size=50, lr=0.003, init_std=0.01,
              routing_init_std=0.3, compare_routes=(1, 2, 4, 8), compare_epochs=60, compare_seeds=5,
              match_steps=50, scaling_samples=1000, cifar=True,
              ablation_images=None, ablation_epochs=60, ablation_seeds=5),
)


def route_heatmaps(matrices, titles, xlabel: str = "route j", ylabel: str = "class",
                   suptitle: str | None = None, cbar_label: str = "mean weight", vmax: float | None = 1.0,
                   per_row: int = 3):
    """Heatmaps of ``(C, M)`` class-by-route matrices (chapter 3), at most ``per_row`` to a row, on
    one colour scale: the learned routing weights and the agreement couplings are drawn by this.
    Panels are sized so that three to a row of four routes each stay within the book's column."""
    mats = [m.detach().float().cpu().numpy() if isinstance(m, torch.Tensor) else m for m in matrices]
    width = mats[0].shape[1] if mats else 0
    return heatmap_grid(mats, titles, xlabel, ylabel, cbar_label, vmax=vmax, per_row=per_row, suptitle=suptitle,
                        panel_width=0.75 + 0.3 * width, panel_height=2.9,
                        xticklabels=[str(j + 1) for j in range(width)])
