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


class Scaling(NamedTuple):
    deviation: torch.Tensor   # (N, M) ||dE_n/dP^j - r_n(j) A^j_n|| / ||dE_n/dP^j||
    norm_ratio: torch.Tensor  # (N, M) ||dE_n/dP^j|| / ||A^j_n||


def route_gradient_vs_alone(sample_energy: Callable, P: torch.Tensor, x: torch.Tensor, y_star: torch.Tensor,
                            r: torch.Tensor, delta: torch.Tensor, chunk: int = 250) -> Scaling:
    """Test chapter 3's claim (Eq. ch3-dyj) with autograd alone: is the gradient reaching route ``j``
    ``r(j)`` times the gradient the route would get on its own from the same output error?

    Args:
        sample_energy: ``sample_energy(P, x_n, y*_n)``, one sample's energy as a function of the route
            weights ``P (M, O, I)`` (any network: the gate may or may not depend on ``P``).
        P: route weights ``(M, O, I)`` at which to differentiate.
        x, y_star: inputs ``(N, I)`` and targets ``(N, O)``.
        r: the network's routing weights ``(N, M)`` at ``P``.
        delta: the network's output error ``dE/dy = y - y*`` ``(N, O)`` at ``P``.

    Per sample ``n`` and route ``j``, ``G^j_n = dE_n/dP^j`` is autograd's gradient of
    ``sample_energy`` (``torch.func.grad`` under ``vmap``) and ``A^j_n`` autograd's vector-Jacobian
    product of the lone route ``sigma(P^j x_n)`` with ``delta_n``. Neither uses the hand derivation.
    Returns :class:`Scaling`: ``deviation = ||G - r A|| / ||G||`` (0 up to rounding when the gate only
    multiplies the route's output) and ``norm_ratio = ||G|| / ||A||`` (then equal to ``r``).
    """
    from torch.func import grad, vjp, vmap

    check_tensor("P", P, dims=3, floating=True, shape_doc="(M, O, I)")
    check_tensor("x", x, dims=2, floating=True, shape_doc="(N, I)")
    check_positive_int("chunk", chunk)
    M, O, I = P.shape
    N = x.shape[0]
    if x.shape[1] != I or y_star.shape != (N, O) or r.shape != (N, M) or delta.shape != (N, O):
        raise ValueError(f"shapes must be P (M, O, I), x (N, I), y_star (N, O), r (N, M), delta (N, O); got "
                         f"P {tuple(P.shape)}, x {tuple(x.shape)}, y_star {tuple(y_star.shape)}, "
                         f"r {tuple(r.shape)}, delta {tuple(delta.shape)}")
    P = P.detach()

    def alone(xn, dn):
        # the M routes side by side, each sigma(P^j x_n) on its own; they do not interact in this map,
        # so the product with delta_n in every route's slot is each lone route's gradient
        _, pullback = vjp(lambda Q: torch.sigmoid(Q @ xn), P)
        return pullback(dn.expand(M, O))[0]

    deviation, ratio = [], []
    for s in range(0, N, chunk):
        sl = slice(s, s + chunk)
        G = vmap(grad(sample_energy), in_dims=(None, 0, 0))(P, x[sl], y_star[sl]).flatten(2)  # (n, M, O*I)
        A = vmap(alone)(x[sl], delta[sl].detach()).flatten(2)
        g_norm = G.norm(dim=2)
        deviation.append((G - r[sl].detach().unsqueeze(2) * A).norm(dim=2) / g_norm.clamp_min(torch.finfo(G.dtype).tiny))
        ratio.append(g_norm / A.norm(dim=2).clamp_min(torch.finfo(A.dtype).tiny))
    return Scaling(torch.cat(deviation), torch.cat(ratio))


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


# ----------------------------------------------------------------------------- ablations of the collapse

VARIANTS = ("slides", "no r in eta", "softmax gate", "competitive error", "gates sum to 1")


def variant_outputs(net: SoftRoutingNet, x: torch.Tensor, variant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(r, Y, y)`` of ``net`` on ``x`` as the training ``variant`` computes them (autograd graph kept).

    * ``"slides"``, ``"gates sum to 1"``: the slides' network, ``r = sigma(R x)``, ``y = r Y``
      (the second differs only in its initialisation, :func:`init_gates_sum_to_one`);
    * ``"no r in eta"``: the same forward values, but the routes receive the output error without the
      factor ``r(j)`` of Eq. ch3-eta (``y = sum_j r_j sg(y^j) + sum_j (y^j - sg(y^j))``, ``sg`` = detach:
      the gate still gets ``delta . y^j``, route ``j`` gets ``delta`` itself);
    * ``"softmax gate"``: ``r = softmax(R x)`` over the routes, ``y = r Y``;
    * ``"competitive error"``: the slides' forward; :func:`variant_energy` scores it differently.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    net._check_x(x)
    a = x @ net.R.T
    r = torch.softmax(a, dim=1) if variant == "softmax gate" else torch.sigmoid(a)
    Y = torch.sigmoid(torch.einsum("moi,ni->nmo", net.P, x))
    if variant == "no r in eta":
        Yd = Y.detach()
        y = torch.einsum("nm,nmo->no", r, Yd) + (Y - Yd).sum(dim=1)
    else:
        y = torch.einsum("nm,nmo->no", r, Y)
    return r, Y, y


def variant_energy(r: torch.Tensor, Y: torch.Tensor, y: torch.Tensor, y_star: torch.Tensor, variant: str) -> torch.Tensor:
    """The energy a variant minimises, summed over the batch: the slides' cooperative
    ``1/2 sum_n ||y*_n - y_n||^2`` for every variant but ``"competitive error"``, whose energy is
    Jacobs et al.'s ``1/2 sum_n sum_j q_n(j) ||y*_n - y^j_n||^2`` with ``q = r / sum_k r(k)``
    (each route is scored on its own output, weighted by its share of the gate)."""
    if variant == "competitive error":
        q = route_distribution(r)
        return 0.5 * (q * ((y_star.unsqueeze(1) - Y) ** 2).sum(dim=2)).sum()
    return energy(y, y_star)


def init_gates_sum_to_one(net: SoftRoutingNet, x: torch.Tensor) -> SoftRoutingNet:
    """Shift the gate's bias (the weight of the constant input, the last column of ``R``) by one common
    amount so that the gates sum to 1 on average over the inputs ``x``: ``mean_n sum_j r_n(j) = 1``
    (found by bisection; the sum falls monotonically as the shift falls)."""
    net._check_x(x)
    if net.routes < 2:
        raise ValueError(f"init_gates_sum_to_one needs at least 2 routes; the net has {net.routes}")
    with torch.no_grad():
        a = x @ net.R.T
        lo, hi = -50.0, 50.0
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if float(torch.sigmoid(a + mid).sum(dim=1).mean()) > 1.0:
                hi = mid
            else:
                lo = mid
        net.R[:, -1] += 0.5 * (lo + hi)
    return net


def train_variant(net: SoftRoutingNet, x: torch.Tensor, labels: torch.Tensor, variant: str, *, epochs: int,
                  batch_size: int, lr: float, seed: int = 0, probe: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """Minibatch gradient descent on :func:`variant_energy` (autograd; same schedule as :func:`train_gd`:
    a seeded permutation per epoch, energy summed over the minibatch, step ``lr``). ``"gates sum to 1"``
    first shifts the gate's bias with :func:`init_gates_sum_to_one` on the training inputs. Records, on ``probe = (x, labels)``
    (default: the training set), the routing entropy and the route-class mutual information (bits), the
    mean gate sum and each route's mean gate ``r(j)`` (``mean_gate``) at initialisation and after every
    epoch, and the probe accuracy after the last one.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    check_positive_int("batch_size", batch_size)
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1; got {epochs!r}")
    if variant == "gates sum to 1":
        init_gates_sum_to_one(net, x)
    px, plab = probe if probe is not None else (x, labels)
    targets = one_hot(labels, net.d_out, dtype=x.dtype)
    gen = torch.Generator().manual_seed(seed)

    def measure(hist):
        with torch.no_grad():
            r, _, y = variant_outputs(net, px, variant)
        hist["entropy"].append(float(routing_entropy(r)))
        hist["mutual_information"].append(float(route_class_mutual_information(r, plab, net.d_out)))
        hist["gate_sum"].append(float(r.sum(dim=1).mean()))
        hist["mean_gate"].append([float(v) for v in r.mean(dim=0)])
        return y

    hist: dict = {"entropy": [], "mutual_information": [], "gate_sum": [], "mean_gate": []}
    measure(hist)
    for _ in range(epochs):
        perm = torch.randperm(x.shape[0], generator=gen).to(x.device)
        for s in range(0, x.shape[0], batch_size):
            idx = perm[s:s + batch_size]
            net.zero_grad(set_to_none=True)
            variant_energy(*variant_outputs(net, x[idx], variant), targets[idx], variant).backward()
            with torch.no_grad():
                for p in (net.R, net.P):
                    p -= lr * p.grad
        y = measure(hist)
    hist["accuracy"] = float((y.argmax(dim=1) == plab).to(torch.float64).mean())
    return hist


# ----------------------------------------------------------------------------- mixing statistics

def route_distribution(r: torch.Tensor) -> torch.Tensor:
    """Routing weights normalised over routes, ``q(j) = r(j) / sum_k r(k)``, ``(N, M)``."""
    check_tensor("r", r, dims=2, floating=True, shape_doc="(N, M)")
    return r / r.sum(dim=1, keepdim=True).clamp_min(torch.finfo(r.dtype).tiny)


def route_usage(r: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mean routing weight of each route over the samples of each class, ``(C, M)``."""
    check_tensor("r", r, dims=2, floating=True, shape_doc="(N, M)")
    check_tensor("labels", labels, dims=1, shape_doc="(N,) integer labels")
    if labels.shape[0] != r.shape[0]:
        raise ValueError(f"labels must be ({r.shape[0]},); got {tuple(labels.shape)}")
    counts = torch.bincount(labels, minlength=num_classes).to(r.dtype).clamp_min(1)
    sums = torch.zeros(num_classes, r.shape[1], dtype=r.dtype, device=r.device).index_add_(0, labels, r)
    return sums / counts.unsqueeze(1)


def routing_entropy(r: torch.Tensor) -> torch.Tensor:
    """Mean over samples of the entropy (bits) of ``q = r / sum r``; ``log2 M`` is an even mix, 0 one route."""
    q = route_distribution(r)
    return (q * torch.log2(1.0 / q.clamp_min(1e-30))).sum(dim=1).mean()


def route_class_mutual_information(r: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mutual information (bits) between route and class under the joint
    ``p(j, c) = 1/N sum_n [label_n = c] q_n(j)`` with ``q = r / sum r``.

    0 when every class uses the routes alike; at most ``min(log2 M, log2 C)``.
    """
    q = route_distribution(r)
    check_tensor("labels", labels, dims=1, shape_doc="(N,) integer labels")
    joint = torch.zeros(num_classes, r.shape[1], dtype=r.dtype, device=r.device).index_add_(0, labels, q)
    joint = joint / joint.sum()
    pc, pj = joint.sum(dim=1, keepdim=True), joint.sum(dim=0, keepdim=True)
    ratio = joint / (pc * pj).clamp_min(1e-30)
    return (joint * torch.log2(ratio.clamp_min(1e-30))).sum()
