"""Soft routing and its hand-written backward pass (chapter 3; lecture slides, seed 000).

The network of the slides: ``M`` routes, route ``j`` with its own weights ``P^j``,

* ``phi^j = P^j x`` and ``y^j = sigma(phi^j)``   (intermediate output of route ``j``),
* ``r = sigma(R x)``                             (soft routing weights, one per route),
* ``y = r Y = sum_j r(j) y^j``                   (the rows of ``Y`` are the ``y^j``),
* ``E = 1/2 sum_n ||y*_n - y_n||^2``              (the energy, summed over the batch),
* ``theta <- theta - rho dE/dtheta``              (the update rule), ``theta = {R, {P^j}}``.

Shapes use the letters ``N`` (samples), ``M`` (routes), ``O`` (outputs, ``d_out``)
and ``I`` (inputs, ``d_in``). There are no biases: append a constant 1 to ``x``
(:func:`with_bias`) to get them.

:func:`manual_gradients` computes ``dE/dR`` and ``dE/dP`` from the chain rule with
plain tensor algebra (no autograd); chapter 3 checks it against autograd.
"""
from __future__ import annotations

import math
import time
from typing import Callable, NamedTuple

import torch
from torch import nn

from .checks import check_positive_int, check_tensor


def _sigmoid(t: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(t)


class SoftRoutingNet(nn.Module):
    """The soft-routing network of the chapter-3 slides: ``y = sigma(R x) . [sigma(P^j x)]_j``.

    Parameters (no biases):
        ``R``: ``(M, I)``, the routing weights, ``r = sigma(R x)`` (slides: soft routing weights).
        ``P``: ``(M, O, I)``, route ``j``'s weights ``P^j``, ``y^j = sigma(P^j x)``.

    ``forward(x)`` maps ``x (N, I)`` to ``y (N, O)``; :meth:`parts` also returns ``r`` and ``Y``.
    ``P`` is drawn from ``N(0, init_std^2)`` and ``R`` from ``N(0, routing_init_std^2)``
    (default: ``init_std``), seeded by ``generator`` if given.
    """

    def __init__(self, d_in: int, d_out: int, routes: int, init_std: float = 0.01,
                 routing_init_std: float | None = None, generator: torch.Generator | None = None,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None):
        super().__init__()
        check_positive_int("d_in", d_in)
        check_positive_int("d_out", d_out)
        check_positive_int("routes", routes)
        routing_init_std = init_std if routing_init_std is None else routing_init_std
        for name, v in (("init_std", init_std), ("routing_init_std", routing_init_std)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} must be a number >= 0; got {v!r}")
        self.d_in, self.d_out, self.routes = d_in, d_out, routes
        dtype = dtype or torch.get_default_dtype()
        R = torch.randn(routes, d_in, generator=generator, dtype=dtype) * routing_init_std
        P = torch.randn(routes, d_out, d_in, generator=generator, dtype=dtype) * init_std
        self.R = nn.Parameter(R.to(device))
        self.P = nn.Parameter(P.to(device))

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, routes={self.routes}"

    def _check_x(self, x: torch.Tensor) -> None:
        check_tensor("x", x, dims=2, floating=True, shape_doc=f"(N, {self.d_in})")
        if x.shape[1] != self.d_in:
            raise ValueError(f"x must be (N, {self.d_in}); got {tuple(x.shape)}")

    def parts(self, x: torch.Tensor) -> "Parts":
        """``r (N, M)``, ``Y (N, M, O)`` and ``y (N, O)`` of the forward map (slides' forward equations)."""
        self._check_x(x)
        r = _sigmoid(x @ self.R.T)                                # r = sigma(R x)
        Y = _sigmoid(torch.einsum("moi,ni->nmo", self.P, x))      # y^j = sigma(P^j x)
        y = torch.einsum("nm,nmo->no", r, Y)                       # y = r Y
        return Parts(r, Y, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts(x).y

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """Soft routing weights ``r = sigma(R x)``, ``(N, M)``."""
        self._check_x(x)
        return _sigmoid(x @ self.R.T)


class Parts(NamedTuple):
    r: torch.Tensor  # (N, M) routing weights
    Y: torch.Tensor  # (N, M, O) route outputs, row j = y^j
    y: torch.Tensor  # (N, O) network output


class Signals(NamedTuple):
    delta: torch.Tensor  # (N, O)    dE/dy = y - y*
    g_r: torch.Tensor    # (N, M)    dE/dr(j) = y^j . delta
    eps: torch.Tensor    # (N, M)    dE/d(Rx)_j = g_r(j) r(j) (1 - r(j))
    eta: torch.Tensor    # (N, M, O) dE/dphi^j = r(j) delta * y^j * (1 - y^j)


def with_bias(x: torch.Tensor) -> torch.Tensor:
    """Flatten ``x (N, ...)`` to ``(N, I)`` and append a constant 1 (so ``R`` and ``P`` carry biases)."""
    check_tensor("x", x, min_dim=2, floating=True)
    flat = x.reshape(x.shape[0], -1)
    return torch.cat([flat, flat.new_ones(flat.shape[0], 1)], dim=1)


def one_hot(y: torch.Tensor, num_classes: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Targets ``y* (N, O)``: one-hot rows of the integer labels ``y (N,)``."""
    check_tensor("y", y, dims=1, shape_doc="(N,) integer labels")
    if y.is_floating_point():
        raise TypeError(f"y must hold integer labels; got dtype {y.dtype}")
    out = torch.zeros(y.shape[0], num_classes, dtype=dtype or torch.get_default_dtype(), device=y.device)
    return out.scatter_(1, y.view(-1, 1), 1.0)


def energy(y: torch.Tensor, y_star: torch.Tensor) -> torch.Tensor:
    """``E = 1/2 sum_n ||y*_n - y_n||^2`` (the slides' energy), summed over the batch."""
    if y.shape != y_star.shape:
        raise ValueError(f"y and y_star must have the same shape (N, O); got {tuple(y.shape)} and "
                         f"{tuple(y_star.shape)}")
    return 0.5 * ((y_star - y) ** 2).sum()


def error_signals(r: torch.Tensor, Y: torch.Tensor, y_star: torch.Tensor) -> Signals:
    """The error signals of the chain rule (chapter 3, Eqs. ch3-delta ... ch3-eta), no autograd.

    Args:
        r: routing weights ``(N, M)`` (from ``sigma(R x)``, or set by hand).
        Y: route outputs ``(N, M, O)``.
        y_star: targets ``(N, O)``.

    Returns ``Signals(delta, g_r, eps, eta)``: ``delta = y - y*`` (N, O);
    ``g_r(j) = delta . y^j`` (N, M), what reaches route ``j``'s gate;
    ``eps = g_r r (1 - r)`` (N, M), the error at the routing pre-activation ``R x``;
    ``eta^j = r(j) delta * y^j * (1 - y^j)`` (N, M, O), the error at ``phi^j = P^j x``,
    scaled by ``r(j)`` -- the slides' point.
    """
    check_tensor("r", r, dims=2, floating=True, shape_doc="(N, M)")
    check_tensor("Y", Y, dims=3, floating=True, shape_doc="(N, M, O)")
    check_tensor("y_star", y_star, dims=2, floating=True, shape_doc="(N, O)")
    if Y.shape[:2] != r.shape or Y.shape[0] != y_star.shape[0] or Y.shape[2] != y_star.shape[1]:
        raise ValueError(f"shapes must be r (N, M), Y (N, M, O), y_star (N, O); got r {tuple(r.shape)}, "
                         f"Y {tuple(Y.shape)}, y_star {tuple(y_star.shape)}")
    y = torch.einsum("nm,nmo->no", r, Y)
    delta = y - y_star                                   # dE/dy
    g_r = torch.einsum("nmo,no->nm", Y, delta)           # dE/dr(j) = y^j . dE/dy
    eps = g_r * r * (1.0 - r)                            # times sigma'(R x) = r (1 - r)
    eta = r.unsqueeze(2) * delta.unsqueeze(1) * Y * (1.0 - Y)  # r(j) dE/dy * sigma'(phi^j)
    return Signals(delta, g_r, eps, eta)


def manual_gradients(net: SoftRoutingNet, x: torch.Tensor, y_star: torch.Tensor) -> dict[str, torch.Tensor]:
    """``dE/dR (M, I)`` and ``dE/dP (M, O, I)`` of the energy over the batch, from the chain rule
    written out by hand (chapter 3, Eqs. ch3-dR and ch3-dP; the slides' gradient
    ``dE/dtheta = dE/dy (dr/dR Y + sum_j r(j) dy^j/dphi^j dphi^j/dP^j)``). No autograd is used.

    Args:
        net: a :class:`SoftRoutingNet`.
        x: inputs ``(N, I)``.
        y_star: targets ``(N, O)``.
    """
    if not isinstance(net, SoftRoutingNet):
        raise TypeError(f"net must be a SoftRoutingNet; got {type(net).__name__}")
    net._check_x(x)
    check_tensor("y_star", y_star, dims=2, floating=True, shape_doc=f"(N, {net.d_out})")
    if y_star.shape != (x.shape[0], net.d_out):
        raise ValueError(f"y_star must be ({x.shape[0]}, {net.d_out}); got {tuple(y_star.shape)}")
    with torch.no_grad():
        R, P = net.R.detach(), net.P.detach()
        r = torch.sigmoid(x @ R.T)                              # (N, M)
        Y = torch.sigmoid(torch.einsum("moi,ni->nmo", P, x))    # (N, M, O)
        s = error_signals(r, Y, y_star)
        grad_R = s.eps.T @ x                                    # sum_n eps_n x_n^T
        grad_P = torch.einsum("nmo,ni->moi", s.eta, x)          # sum_n eta^j_n x_n^T
    return {"R": grad_R, "P": grad_P}


def route_gradient_norms(P: torch.Tensor, x: torch.Tensor, y_star: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Frobenius norms ``||dE/dP^j||`` per route ``(M,)`` when the routing weights are ``r``
    (``(M,)`` shared by the batch or ``(N, M)``), e.g. set by hand (chapter 3's widget)."""
    check_tensor("P", P, dims=3, floating=True, shape_doc="(M, O, I)")
    M = P.shape[0]
    if r.dim() == 1:
        r = r.unsqueeze(0).expand(x.shape[0], M)
    with torch.no_grad():
        Y = torch.sigmoid(torch.einsum("moi,ni->nmo", P, x))
        eta = error_signals(r.to(Y.dtype), Y, y_star).eta
        return torch.einsum("nmo,ni->moi", eta, x).flatten(1).norm(dim=1)


def gd_step(net: SoftRoutingNet, x: torch.Tensor, y_star: torch.Tensor, lr: float) -> float:
    """One step of the slides' update rule ``theta <- theta - rho dE/dtheta`` with
    :func:`manual_gradients`; returns the energy ``E`` before the step."""
    with torch.no_grad():
        E = float(energy(net(x), y_star))
        g = manual_gradients(net, x, y_star)
        net.R.sub_(lr * g["R"])
        net.P.sub_(lr * g["P"])
    return E


def accuracy(net: SoftRoutingNet, x: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of samples whose largest output is the label."""
    with torch.no_grad():
        return float((net(x).argmax(dim=1) == labels).double().mean())


def train_gd(net: SoftRoutingNet, x: torch.Tensor, labels: torch.Tensor, *, epochs: int, batch_size: int,
             lr: float, seed: int = 0, val: tuple[torch.Tensor, torch.Tensor] | None = None,
             on_epoch_end: Callable | None = None, progress: bool = True, desc: str = "GD") -> dict:
    """Minibatch gradient descent with the hand-coded gradients (chapter 3).

    Each step applies :func:`gd_step` to a slice of a seeded permutation; ``E`` is
    summed over the minibatch, so ``lr`` is the slides' ``rho`` per minibatch.
    ``on_epoch_end(epoch, net, history)`` may add lists to ``history``.
    Returns ``history`` with ``step_energy`` (per step), ``loss`` (mean E per sample per
    epoch), ``train_acc``, ``val_acc`` and ``seconds``.
    """
    check_positive_int("batch_size", batch_size)
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an int >= 0; got {epochs!r}")
    targets = one_hot(labels, net.d_out, dtype=x.dtype)
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    history: dict = {"step_energy": [], "loss": [], "train_acc": [], "val_acc": [], "seconds": []}
    for epoch in range(epochs):
        t0 = time.perf_counter()
        perm = torch.randperm(n, generator=gen).to(x.device)
        total = 0.0
        for s in range(0, n, batch_size):
            idx = perm[s:s + batch_size]
            E = gd_step(net, x[idx], targets[idx], lr)
            history["step_energy"].append(E)
            total += E
        history["seconds"].append(time.perf_counter() - t0)
        history["loss"].append(total / n)
        history["train_acc"].append(accuracy(net, x, labels))
        history["val_acc"].append(accuracy(net, *val) if val is not None else float("nan"))
        if on_epoch_end is not None:
            on_epoch_end(epoch, net, history)
        if progress:
            va = history["val_acc"][-1]
            print(f"{desc} epoch {epoch + 1}/{epochs}: E/sample {history['loss'][-1]:.4f}  "
                  f"train acc {history['train_acc'][-1]:.3f}" + ("" if math.isnan(va) else f"  val acc {va:.3f}")
                  + f"  {history['seconds'][-1]:.2f} s")
    return history
