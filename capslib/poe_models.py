"""The model of Hauser 2019, Fig. 1, and the trainings of its ``W`` and ``U`` (chapter 7).

:class:`PoECapsules` stacks a convolutional autoencoder (:class:`ConvAutoencoder`), the conversion of
its code to squashed input capsules and back (:func:`code_to_capsules`, :func:`capsules_to_code`), the
weights ``W`` that route the input capsules up (trained by :func:`train_weights`, CD-1 with mixing by
dynamic routing, Algorithm 1) and the decoder ``U`` that routes them down (:func:`train_decoder`,
Sec. 4.1). Neither ``W`` nor ``U`` is trained by back-propagation: their update rules are in
:mod:`capslib.poe`.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .checks import check_positive_int, check_tensor
from .ops import squash, unsquash
from .poe import (_EPS, _check_w, _check_x, cd1, cosine_routing, decode_capsules, decoder_gradient,
                  route_forward, sparsity_term, votes)


# ----------------------------------------------------------------------------- training W and U

def _sgd_epochs(P: torch.Tensor, n: int, step, *, epochs: int, lr: float, batch: int, momentum: float,
                decay: float, l2: float, generator: torch.Generator | None, after_epoch) -> None:
    """The update schedule of Sec. 4.1 as the book runs it: per minibatch ``v <- momentum v + (step - l2 P)``,
    ``P <- P + lr v``; ``lr <- decay lr`` after every epoch. ``step(idx)`` returns the ascent direction
    for the minibatch ``idx`` (and may record what it measures); ``after_epoch()`` runs after each epoch."""
    check_positive_int("epochs", epochs, minimum=0)
    check_positive_int("batch", batch)
    velocity = torch.zeros_like(P)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator)
        for k in range(0, n, batch):
            delta = step(perm[k:k + batch].to(P.device))
            velocity.mul_(momentum).add_(delta - l2 * P)          # SGD with momentum, l2 penalty on P
            P.add_(lr * velocity)
        lr *= decay                                                # learning-rate decay per epoch
        after_epoch()


@torch.no_grad()
def train_weights(W: torch.Tensor, x: torch.Tensor, *, epochs: int, lr: float, batch: int, iterations: int = 3,
                  momentum: float = 0.9, decay: float = 0.9, l2: float = 1e-4,
                  generator: torch.Generator | None = None, normalize: str = "outputs",
                  sparsity: tuple[float, float] | None = None) -> dict[str, list[float]]:
    """Train ``W (I, J, Do, Di)`` in place by CD-1 with mixing by dynamic routing (Hauser, Algorithm 1;
    chapter 7): for each minibatch of ``x (N, I, Di)``, ``Delta W`` of :func:`capslib.poe.cd1`, then SGD with
    momentum, an ``l2`` penalty on ``W`` and learning-rate decay per epoch. No labels, no back-propagation.

    Returns the per-epoch history: ``reconstruction`` (mean ``(x - x~)^2`` of the one-step chain),
    ``free_energy_gap`` (mean ``F(x) - F(x~)`` in nats, the CD-1 proxy; ``F = sum_j log(1 - ||y_j||)``
    since ``1 - ||squash(z)|| = 1 / (1 + ||z||^2)``), ``firing`` (mean ``P(h_j = 1 | x)`` over images and
    capsules) and ``weight_norm`` (``||W||_F``). ``sparsity = (strength, target)`` adds ``strength *``
    :func:`capslib.poe.sparsity_term` with that target to every CD-1 update (chapter 7's control).
    """
    _check_w(W)
    _check_x(W, x)
    if sparsity is not None:
        strength, target = sparsity
        if strength < 0:
            raise ValueError(f"strength must be >= 0; got {strength}")
    history: dict[str, list[float]] = {"reconstruction": [], "free_energy_gap": [], "firing": [], "weight_norm": []}
    sums = {"rec": 0.0, "gap": 0.0, "fire": 0.0}

    def step(idx):
        xb = x[idx]
        r = cd1(W, xb, iterations, normalize)
        sums["rec"] += ((xb - r.x_tilde) ** 2).mean().item() * len(xb)
        sums["gap"] += (torch.log1p(-r.y.norm(dim=-1)) - torch.log1p(-r.y_tilde.norm(dim=-1))).sum().item()
        sums["fire"] += r.y.norm(dim=-1).mean().item() * len(xb)
        if sparsity is None:
            return r.delta
        return r.delta + strength * sparsity_term(W, xb, r.c, target)

    def after_epoch():
        history["reconstruction"].append(sums["rec"] / len(x))
        history["free_energy_gap"].append(sums["gap"] / len(x))
        history["firing"].append(sums["fire"] / len(x))
        history["weight_norm"].append(W.norm().item())
        sums["rec"] = sums["gap"] = sums["fire"] = 0.0

    _sgd_epochs(W, len(x), step, epochs=epochs, lr=lr, batch=batch, momentum=momentum, decay=decay, l2=l2,
                generator=generator, after_epoch=after_epoch)
    return history


@torch.no_grad()
def train_decoder(U: torch.Tensor, y: torch.Tensor, target: torch.Tensor, *, epochs: int, lr: float, batch: int,
                  iterations: int = 3, momentum: float = 0.9, decay: float = 0.9, l2: float = 1e-4,
                  generator: torch.Generator | None = None, evaluate=None) -> dict[str, list[float]]:
    """Train the decoder ``U (I, J, Di, Do)`` in place with :func:`capslib.poe.decoder_gradient` (Hauser, Sec. 4.1;
    chapter 7) on pairs ``(target (N, I, Di), y (N, J, Do))``, the same schedule as :func:`train_weights`.

    ``evaluate()`` (optional) runs after every epoch and returns a dict of numbers; the history holds
    one list per key.
    """
    check_tensor("y", y, dims=3, floating=True, shape_doc="(N, J, Do)")
    check_tensor("target", target, dims=3, floating=True, shape_doc="(N, I, Di)")
    if len(y) != len(target):
        raise ValueError(f"y and target must hold the same number of samples; got {len(y)} and {len(target)}")
    history: dict[str, list[float]] = {}

    def after_epoch():
        for k, v in (evaluate() if evaluate is not None else {}).items():
            history.setdefault(k, []).append(float(v))

    _sgd_epochs(U, len(y), lambda idx: decoder_gradient(U, y[idx], target[idx], iterations), epochs=epochs,
                lr=lr, batch=batch, momentum=momentum, decay=decay, l2=l2, generator=generator,
                after_epoch=after_epoch)
    return history


@torch.no_grad()
def train_weights_sparse(W: torch.Tensor, x: torch.Tensor, *, epochs: int, lr: float, batch: int, strength: float,
                         target: float, iterations: int = 3, momentum: float = 0.9, decay: float = 0.9,
                         l2: float = 1e-4, generator: torch.Generator | None = None) -> dict[str, list[float]]:
    """:func:`train_weights` with ``strength *`` :func:`capslib.poe.sparsity_term` added to every CD-1 update
    (chapter 7's control: an explicit pressure on each expert to fire for only a share ``target`` of the images).
    Returns :func:`train_weights`'s history (``reconstruction``, ``firing``, ``weight_norm``, ...).
    """
    return train_weights(W, x, epochs=epochs, lr=lr, batch=batch, iterations=iterations, momentum=momentum,
                         decay=decay, l2=l2, generator=generator, sparsity=(strength, target))


# ----------------------------------------------------------------------------- front end and model

def code_to_capsules(h: torch.Tensor, dim: int = 8) -> torch.Tensor:
    """Feature map ``(B, C, H, W)`` -> capsules ``(B, H*W*C/dim, dim)``, squashed (Hauser, Sec. 4.1).

    Each capsule is ``dim`` consecutive channels at one position; inverse: :func:`capsules_to_code`.
    """
    check_tensor("h", h, dims=4, floating=True, shape_doc="(B, C, H, W)")
    B, C, H, W = h.shape
    if C % dim:
        raise ValueError(f"h has C = {C} channels, not a multiple of the capsule dim {dim}")
    caps = h.view(B, C // dim, dim, H, W).permute(0, 3, 4, 1, 2).reshape(B, H * W * C // dim, dim)
    return squash(caps)


def capsules_to_code(x: torch.Tensor, shape: tuple[int, int, int], max_length: float = 0.999) -> torch.Tensor:
    """Capsules ``(B, I, dim)`` -> feature map ``(B, C, H, W)``: clamp lengths below
    ``max_length``, unsquash (Hauser, Eq. 6), reshape. ``shape = (C, H, W)``."""
    check_tensor("x", x, dims=3, floating=True, shape_doc="(B, I, D)")
    C, H, W = shape
    B, I, D = x.shape
    if I * D != C * H * W:
        raise ValueError(f"x (B, I, D) = {tuple(x.shape)} does not fill a ({C}, {H}, {W}) feature map")
    if not 0.0 < max_length < 1.0:
        raise ValueError(f"max_length must lie in (0, 1); got {max_length}")
    n = x.norm(dim=-1, keepdim=True)
    x = x * (n.clamp(max=max_length) / n.clamp_min(_EPS))
    z = unsquash(x)
    return z.view(B, H, W, C // D, D).permute(0, 3, 4, 1, 2).reshape(B, C, H, W)


class ConvAutoencoder(nn.Module):
    """Convolutional autoencoder front end (Hauser, Sec. 4.1 and Fig. 1; chapter 7).

    Encoder: ``kernel x kernel`` conv ``1 -> channels``, leaky ReLU, dropout, then
    ``channels -> channels`` stride 2, leaky ReLU. Decoder: the transposed filters of
    the same two convolutions (tied weights, own biases), leaky ReLU between, sigmoid
    output. 28x28 images give a ``(channels, 6, 6)`` code.
    """

    def __init__(self, in_channels: int = 1, channels: int = 128, kernel: int = 9, dropout: float = 0.1,
                 slope: float = 0.1):
        super().__init__()
        check_positive_int("channels", channels)
        self.conv1 = nn.Conv2d(in_channels, channels, kernel)
        self.conv2 = nn.Conv2d(channels, channels, kernel, stride=2)
        self.bias1 = nn.Parameter(torch.zeros(in_channels))
        self.bias2 = nn.Parameter(torch.zeros(channels))
        self.drop = nn.Dropout(dropout)
        self.slope = slope

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C_in, 28, 28)`` -> code ``(B, channels, 6, 6)``."""
        check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
        a = self.drop(F.leaky_relu(self.conv1(x), self.slope))
        return F.leaky_relu(self.conv2(a), self.slope)

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        """Code ``(B, channels, 6, 6)`` -> image ``(B, C_in, 28, 28)`` in ``(0, 1)``."""
        check_tensor("h", h, dims=4, floating=True, shape_doc="(B, C, H, W)")
        a = F.conv_transpose2d(h, self.conv2.weight, self.bias2, stride=2, output_padding=1)
        a = F.leaky_relu(a, self.slope)
        return torch.sigmoid(F.conv_transpose2d(a, self.conv1.weight, self.bias1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


class PoECapsules(nn.Module):
    """Products of expert capsules (Hauser 2019, Fig. 1; chapter 7).

    Conv autoencoder -> ``I`` squashed capsules of ``capsule_dim`` -> ``W`` (CD-1,
    Algorithm 1) -> ``out_caps`` capsules of ``out_dim`` -> decoder ``U`` -> unsquash
    -> transposed convolutions. ``W`` and ``U`` are trained by the update rules of
    this module, not by back-propagation.
    """

    def __init__(self, channels: int = 128, kernel: int = 9, capsule_dim: int = 8, out_caps: int = 20,
                 out_dim: int = 16, iterations: int = 3, dropout: float = 0.1, init_std: float = 0.01,
                 image_size: int = 28):
        super().__init__()
        check_positive_int("iterations", iterations)
        self.autoencoder = ConvAutoencoder(1, channels, kernel, dropout)
        side1 = image_size - kernel + 1
        side = (side1 - kernel) // 2 + 1
        if (side - 1) * 2 + kernel + 1 != side1:
            raise ValueError(f"image_size={image_size} does not invert through the stride-2 {kernel}x{kernel} conv")
        self.code_shape = (channels, side, side)
        self.capsule_dim, self.iterations, self.init_std = capsule_dim, iterations, init_std
        in_caps = side * side * channels // capsule_dim
        self.W = nn.Parameter(init_std * torch.randn(in_caps, out_caps, out_dim, capsule_dim), requires_grad=False)
        self.U = nn.Parameter(init_std * torch.randn(in_caps, out_caps, capsule_dim, out_dim), requires_grad=False)

    @property
    def in_caps(self) -> int:
        return self.W.shape[0]

    def with_experts(self, seed: int) -> "PoECapsules":
        """A copy that shares this model's autoencoder (the same module: trained once, frozen) and holds
        new ``W`` and ``U``, drawn from ``N(0, init_std^2)`` with a generator seeded by ``seed``: one more
        run of the CD-1 and decoder stages on the same input capsules (chapter 7's seeds)."""
        check_positive_int("seed", seed, minimum=0)
        ae, self.autoencoder = self.autoencoder, None
        try:
            other = copy.deepcopy(self)                  # sizes, W and U; not the autoencoder
        finally:
            self.autoencoder = ae
        other.autoencoder = ae
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for P in (other.W, other.U):
                P.copy_(self.init_std * torch.randn(P.shape, generator=g, dtype=P.dtype).to(P.device))
        return other

    def capsules(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``(B, 1, 28, 28)`` -> squashed input capsules ``(B, I, capsule_dim)``."""
        return code_to_capsules(self.autoencoder.encode(images), self.capsule_dim)

    def encode(self, x: torch.Tensor):
        """Input capsules ``(B, I, Di)`` -> ``(y (B, J, Do), c (B, I, J))``: route with ``W``, squash."""
        c = cosine_routing(votes(self.W, x), self.iterations)
        return squash(route_forward(self.W, x, c)), c

    def decode(self, y: torch.Tensor) -> torch.Tensor:
        """Output capsules ``(B, J, Do)`` -> images: route with ``U``, unsquash, reshape, transposed convs."""
        x = decode_capsules(self.U, y, self.iterations)
        return self.autoencoder.decode(capsules_to_code(x, self.code_shape))

    @torch.no_grad()
    def generate(self, capsule: int, g: torch.Tensor, hemisphere: torch.Tensor | None = None) -> torch.Tensor:
        """Images from capsule ``capsule`` alone (Hauser, Sec. 4.2 and Fig. 2; chapter 7).

        ``g (N, Do)`` Gaussian samples become that capsule's pre-activation (the other
        capsules are 0); with ``hemisphere (Do,)`` a sample with ``g . hemisphere < 0``
        is flipped to ``-g`` (the restricted domain). Returns ``(N, 1, 28, 28)``.
        """
        J, Do = self.W.shape[1], self.W.shape[2]
        if not 0 <= capsule < J:
            raise ValueError(f"capsule must lie in [0, {J}); got {capsule}")
        check_tensor("g", g, dims=2, floating=True, shape_doc="(N, Do)")
        if g.shape[1] != Do:
            raise ValueError(f"g must be (N, {Do}); got {tuple(g.shape)}")
        if hemisphere is not None:
            g = torch.where((g @ hemisphere < 0).unsqueeze(1), -g, g)
        y = g.new_zeros(g.shape[0], J, Do)
        y[:, capsule] = squash(g)
        return self.decode(y)
