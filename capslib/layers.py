"""Capsule layers (chapters 1 and 2).

``PrimaryCaps`` turns a feature map into capsule vectors; ``DenseCaps`` maps every
input capsule to every output capsule with its own matrix and routes the votes.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .checks import check_positive_int, check_tensor
from .ops import squash
from .routing import dynamic_routing


class PrimaryCaps(nn.Module):
    """Convolutional primary capsules (Sabour et al. 2017, Sec. 4; chapter 1).

    A convolution with ``types * dim`` output channels; each spatial position of
    each type is one capsule of ``dim`` components, squashed.

    Input ``(B, C, H, W)`` -> output ``(B, I, dim)`` with ``I = types * H' * W'``,
    ordered type-major (all positions of type 0 first).
    """

    def __init__(self, in_channels: int, types: int = 32, dim: int = 8, kernel_size: int = 9, stride: int = 2):
        super().__init__()
        for name, v in [("in_channels", in_channels), ("types", types), ("dim", dim),
                        ("kernel_size", kernel_size), ("stride", stride)]:
            check_positive_int(name, v)
        self.in_channels, self.types, self.dim = in_channels, types, dim
        self.conv = nn.Conv2d(in_channels, types * dim, kernel_size, stride)

    def output_grid(self, height: int, width: int) -> tuple[int, int]:
        k, s = self.conv.kernel_size[0], self.conv.stride[0]
        return (height - k) // s + 1, (width - k) // s + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"x must be (B, {self.in_channels}, H, W); got {tuple(x.shape)}")
        u = self.conv(x)
        B, _, H, W = u.shape
        u = u.view(B, self.types, self.dim, H, W).permute(0, 1, 3, 4, 2)
        return squash(u.reshape(B, self.types * H * W, self.dim))


class DenseCaps(nn.Module):
    """Fully connected capsule layer with routing (Sabour et al. 2017, Eq. 2; chapter 2).

    Votes ``u_hat_{j|i} = W_ij u_i`` with ``W`` of shape ``(I, J, D_out, D_in)``,
    then ``routing_fn(u_hat, iterations, detach)`` -> ``(v, c)``.

    ``routing_fn`` defaults to :func:`capslib.dynamic_routing`; chapters swap it
    (e.g. quantized couplings in chapter 6). ``detach`` may be flipped between
    steps (chapter 4).

    Input ``(B, I, D_in)`` -> ``(v (B, J, D_out), c (B, I, J))``.
    """

    def __init__(
        self,
        in_caps: int,
        in_dim: int,
        out_caps: int,
        out_dim: int,
        iterations: int = 3,
        detach: bool = False,
        init_std: float = 0.01,
        routing_fn: Callable | None = None,
    ):
        super().__init__()
        for name, v in [("in_caps", in_caps), ("in_dim", in_dim), ("out_caps", out_caps),
                        ("out_dim", out_dim), ("iterations", iterations)]:
            check_positive_int(name, v)
        self.in_caps, self.in_dim, self.out_caps, self.out_dim = in_caps, in_dim, out_caps, out_dim
        self.iterations = iterations
        self.detach = detach
        self.routing_fn = routing_fn or dynamic_routing
        self.W = nn.Parameter(init_std * torch.randn(in_caps, out_caps, out_dim, in_dim))

    def votes(self, u: torch.Tensor) -> torch.Tensor:
        """``u (B, I, D_in)`` -> ``u_hat (B, I, J, D_out)``."""
        check_tensor("u", u, dims=3, floating=True, shape_doc="(B, I, D_in)")
        if u.shape[1:] != (self.in_caps, self.in_dim):
            raise ValueError(
                f"u must be (B, {self.in_caps}, {self.in_dim}) = (B, I, D_in); got {tuple(u.shape)}"
            )
        W = self.W
        if hasattr(self, "W_mask") and hasattr(self, "W_orig"):
            # pruned with torch.nn.utils.prune: use the masked weights even when votes() is
            # called outside forward (whose pre-hook is what normally refreshes W)
            W = self.W_orig * self.W_mask
        return torch.einsum("ijdk,bik->bijd", W.to(u.dtype), u)

    def forward(self, u: torch.Tensor):
        u_hat = self.votes(u)
        if u_hat.dtype in (torch.float16, torch.bfloat16):
            # Mixed precision: votes come out of bf16 matmuls, but the routing softmax,
            # squash and agreements run in float32 (the iterations amplify rounding).
            with torch.autocast(device_type=u_hat.device.type, enabled=False):
                return self.routing_fn(u_hat.float(), self.iterations, self.detach)
        return self.routing_fn(u_hat, self.iterations, self.detach)

    def extra_repr(self) -> str:
        return (f"in_caps={self.in_caps}, in_dim={self.in_dim}, out_caps={self.out_caps}, "
                f"out_dim={self.out_dim}, iterations={self.iterations}, detach={self.detach}")


def __getattr__(name):  # layers that live with their chapter's module
    if name in ("MatrixCaps", "ConvCaps", "PrimaryMatrixCaps", "ClassCaps"):
        from . import em_layers
        return getattr(em_layers, name)
    raise AttributeError(f"module 'capslib.layers' has no attribute {name!r}")
