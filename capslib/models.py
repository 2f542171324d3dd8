"""The CapsNet of Sabour et al. 2017 (chapter 2) and pointers to the other models.

Constructor arguments are the paper's hyper-parameters with the paper's
defaults; profiles pass smaller values.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .checks import check_positive_int, check_tensor
from .layers import DenseCaps, PrimaryCaps
from .ops import margin_loss


class CapsOutput(NamedTuple):
    lengths: torch.Tensor          # (B, J) class-capsule lengths
    poses: torch.Tensor            # (B, J, D) class capsules
    reconstruction: torch.Tensor   # (B, C, H, W) decoder output in [0, 1]
    couplings: torch.Tensor        # (B, I, J) last-iteration couplings


class CapsNet(nn.Module):
    """CapsNet of Sabour et al. 2017 (Sec. 4, Fig. 1 and 2; chapter 2).

    Conv (``conv_channels`` 9x9, ReLU) -> PrimaryCaps (``primary_types`` x
    ``primary_dim``-D, 9x9 stride 2) -> DigitCaps (``num_classes`` x
    ``digit_dim``-D, ``iterations`` routing iterations) and a decoder
    (``decoder`` hidden sizes, ReLU, sigmoid output) fed by the class capsule of
    the true label in training and of the longest capsule otherwise.

    ``forward(x, y=None)`` with ``x (B, C, H, W)`` returns :class:`CapsOutput`.
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 28,
        conv_channels: int = 256,
        conv_kernel: int = 9,
        primary_types: int = 32,
        primary_dim: int = 8,
        primary_kernel: int = 9,
        primary_stride: int = 2,
        num_classes: int = 10,
        digit_dim: int = 16,
        iterations: int = 3,
        detach: bool = False,
        decoder: tuple[int, ...] = (512, 1024),
    ):
        super().__init__()
        check_positive_int("image_size", image_size)
        self.in_channels, self.image_size, self.num_classes = in_channels, image_size, num_classes
        self.conv = nn.Conv2d(in_channels, conv_channels, conv_kernel)
        side = image_size - conv_kernel + 1
        if side < primary_kernel:
            raise ValueError(f"image_size={image_size} is too small for the two {conv_kernel}x{conv_kernel} and "
                             f"{primary_kernel}x{primary_kernel} convolutions")
        self.primary = PrimaryCaps(conv_channels, primary_types, primary_dim, primary_kernel, primary_stride)
        gh, gw = self.primary.output_grid(side, side)
        self.digit = DenseCaps(primary_types * gh * gw, primary_dim, num_classes, digit_dim, iterations, detach)
        sizes = [num_classes * digit_dim, *decoder]
        layers: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU(inplace=True)]
        layers += [nn.Linear(sizes[-1], in_channels * image_size * image_size), nn.Sigmoid()]
        self.decoder = nn.Sequential(*layers)

    def encode(self, x: torch.Tensor):
        """``x (B, C, H, W)`` -> ``(v (B, J, D), c (B, I, J))``."""
        check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
        expected = (self.in_channels, self.image_size, self.image_size)
        if tuple(x.shape[1:]) != expected:
            raise ValueError(f"x must be (B, {expected[0]}, {expected[1]}, {expected[2]}); got {tuple(x.shape)}")
        return self.digit(self.primary_capsules(x))

    def primary_capsules(self, x: torch.Tensor) -> torch.Tensor:
        """``x (B, C, H, W)`` -> the squashed primary capsules ``u (B, I, D_in)`` that
        ``DenseCaps`` turns into votes (no shape checks: :meth:`encode` does those)."""
        return self.primary(torch.relu(self.conv(x)))

    def decode(self, poses: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """Reconstruct from the class capsule ``label`` only (the others masked to 0)."""
        mask = torch.nn.functional.one_hot(label, self.num_classes).to(poses.dtype)
        flat = (poses * mask.unsqueeze(-1)).flatten(1)
        out = self.decoder(flat)
        return out.view(-1, self.in_channels, self.image_size, self.image_size)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> CapsOutput:
        v, c = self.encode(x)
        lengths = v.norm(dim=-1)
        label = y if y is not None else lengths.argmax(dim=1)
        return CapsOutput(lengths, v, self.decode(v, label), c)


def capsnet_loss(out: CapsOutput, x: torch.Tensor, y: torch.Tensor, recon_weight: float = 0.0005):
    """Margin loss (Eq. 4) plus ``recon_weight`` x the sum of squared pixel errors, batch mean (Sec. 4.1)."""
    dt = torch.promote_types(out.lengths.dtype, torch.float32)   # bf16 -> float32; float64 stays
    recon = ((out.reconstruction.to(dt) - x.to(dt)) ** 2).flatten(1).sum(dim=1).mean()
    return margin_loss(out.lengths.to(dt), y) + recon_weight * recon


_ELSEWHERE = {
    "EMCapsNet": "em_layers",
    "FCCapsNet": "rem",
    "SoftRoutingNet": "soft_routing",
    "PoECapsules": "poe_models",
}


def __getattr__(name):  # models that live with their chapter's module
    if name in _ELSEWHERE:
        import importlib
        return getattr(importlib.import_module(f"capslib.{_ELSEWHERE[name]}"), name)
    raise AttributeError(f"module 'capslib.models' has no attribute {name!r}")


def count_parameters(model: nn.Module, nonzero: bool = False) -> int:
    """Number of parameters; with ``nonzero=True`` only the non-zero entries of the
    effective weights (a ``torch.nn.utils.prune`` mask applied), as chapter 6 counts them."""
    total = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name.endswith("_orig"):  # pruned: the effective tensor is the masked attribute
                p = getattr(module, name[: -len("_orig")])
            total += int((p != 0).sum().item()) if nonzero else p.numel()
    return total
