import matplotlib

matplotlib.use("Agg")
import numpy as np
import torch

from capslib import viz


def test_tile_places_each_image():
    imgs = torch.arange(6, dtype=torch.float32).view(6, 1, 1, 1).expand(6, 1, 2, 3).contiguous()
    m = viz.tile(imgs, ncol=4, pad=1, fill=-1)
    assert m.shape == (2 * 3 - 1, 4 * 4 - 1)
    assert m[0, 0] == 0 and m[0, 4] == 1 and m[3, 0] == 4 and m[3, 4] == 5
    assert m[2, 0] == -1 and m[3, 8] == -1  # padding row and the empty slot


def test_image_grid_both_layouts():
    imgs = torch.rand(2, 5, 1, 8, 8)
    fig = viz.image_grid(imgs, title="t")
    assert len(fig.axes) == 1
    fig2 = viz.image_grid(imgs[0], titles=list("abcde"))
    assert len(fig2.axes) == 5
    matplotlib.pyplot.close("all")
