"""Chapter 3 (soft-routing gradients): its sizes per profile, its figures, and its experiment units
at paper scale (``03/routes/M<M>/s<k>``, ``03/ablation/<variant>/s<k>``; see the notes above
:func:`unit_run`) with the views that draw them; the ablation's variants and the measures of route use
(entropy, mutual information). The network, its gradients and training live in the library,
:mod:`capslib.soft_routing`."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np
import torch

from .. import data, soft_routing as sr, train
from ..checks import check_positive_int, check_tensor
from ..soft_routing import SoftRoutingNet, energy, one_hot
from . import profiles
from .units import Unit, encode_array, register, seed_spread
from .viz import heatmap_grid

CHAPTER = "03_soft_routing_gradients"


# ----------------------------------------------------------------------------- the collapse's ablations; route use and entropy

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
    """Minibatch gradient descent on :func:`variant_energy` (autograd; same schedule as :func:`capslib.soft_routing.train_gd`:
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


# Chapter 3's sizes. The slides give no hyper-parameters, so `full` is this book's
# choice on the full datasets the slides show results for (MNIST here; CIFAR-10
# where torchvision's files are on disk). ablation_*: the slides' network and its four ablations (images,
# epochs, seeds) and the margins of practical equivalence of their paired differences, declared before the
# runs: ablation_margin for the routing entropy and the mutual information (bits), ablation_acc_margin for
# the accuracy on the validation digits.
# world_*: the small world where specialising pays (:func:`specialist_world`), the same at both profiles
# (seconds on a CPU): groups (= routes), input dimension, the groups' distance from the origin, training and
# test examples, and the training of every variant (epochs, minibatch, step size, initial SD of R and P, seeds).
# Its comparisons read against the ablation's margins.
WORLD = dict(world_groups=4, world_dim=6, world_spread=3.0, world_train=1500, world_test=2000, world_epochs=30,
             world_batch_size=32, world_lr=0.2, world_init_std=0.1, world_seeds=5)
profiles.register(
    CHAPTER,
    ci=dict(dataset="embedded", routes=4, epochs=20, batch_size=50, lr=0.003, init_std=0.01,
            routing_init_std=0.3, compare_routes=(1, 2, 4, 8), compare_epochs=20, compare_seeds=3,
            match_steps=50, scaling_samples=1000, cifar=False,
            ablation_images=1000, ablation_epochs=30, ablation_seeds=5, ablation_margin=0.1,
            ablation_acc_margin=0.02, **WORLD),
    full=dict(dataset="mnist", routes=4, epochs=60, batch_size=50, lr=0.003, init_std=0.01,
              routing_init_std=0.3, compare_routes=(1, 2, 4, 8), compare_epochs=60, compare_seeds=5,
              match_steps=50, scaling_samples=1000, cifar=True,
              ablation_images=None, ablation_epochs=60, ablation_seeds=5, ablation_margin=0.1,
              ablation_acc_margin=0.005, **WORLD),
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


# ============================================================================= the small world

def specialist_world(n: int, groups: int = 4, dim: int = 6, spread: float = 3.0, seed: int = 0,
                     rules_seed: int = 0):
    """Inputs whose class follows a different rule in each of ``groups`` groups, for chapter 3's small world.

    Group ``k`` is a unit Gaussian centred ``spread`` along axis ``k``; within it the class (two classes)
    is the side of a hyperplane through the centre, ``[w_k . (x - centre_k) > 0]``, with ``w_k`` a random
    unit vector of the group (drawn from ``rules_seed``, so that a training and a test set share them).
    One sigmoid route reads one linear rule and cannot follow ``groups`` of them; a route per group can,
    and the gate can tell the groups apart from ``x``. Returns ``(x (n, dim + 1)`` with the constant input
    appended, ``y (n,)`` the class, ``k (n,)`` the group)."""
    if n < 1 or groups < 2 or dim < groups:
        raise ValueError(f"need n >= 1, groups >= 2 and dim >= groups; got n={n}, groups={groups}, dim={dim}")
    rules = specialist_rules(groups, dim, rules_seed)
    centres = spread * torch.eye(groups, dim)
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(groups, (n,), generator=g)
    z = torch.randn(n, dim, generator=g)
    y = ((z * rules[k]).sum(dim=1) > 0).long()
    return sr.with_bias(centres[k] + z), y, k


def specialist_rules(groups: int, dim: int, rules_seed: int = 0) -> torch.Tensor:
    """The unit normals ``w_k (groups, dim)`` of :func:`specialist_world`'s class rules."""
    rules = torch.randn(groups, dim, generator=torch.Generator().manual_seed(rules_seed))
    return rules / rules.norm(dim=1, keepdim=True)


def mean_gate_accuracy(net: sr.SoftRoutingNet, x: torch.Tensor, labels: torch.Tensor, variant: str) -> float:
    """Accuracy of ``net`` with every input's gates replaced by their mean over ``x``: the same routes,
    mixed in the same average proportions, but no longer chosen per input (``variant`` as in
    :func:`variant_outputs`)."""
    with torch.no_grad():
        r, Y, _ = variant_outputs(net, x, variant)
        y = torch.einsum("m,nmo->no", r.mean(dim=0), Y)
    return float((y.argmax(dim=1) == labels).to(torch.float64).mean())


def world_run(variant: str, seed: int, world: tuple, test: tuple, cfg, routes: int | None = None):
    """One network of the small world trained as ``variant`` (:func:`train_variant`,
    float32) from ``seed``. Returns ``(metrics, usage)``: the test accuracy, the accuracy with the gates fixed
    at their mean (:func:`mean_gate_accuracy`), the routing entropy and the mutual information between
    route and group (bits) at initialisation and after training; and the mean share ``q(j)`` of each route
    per group, ``(groups, M)``, on the test inputs. ``world`` and ``test`` are :func:`specialist_world`'s
    ``(x, y, k)``; ``routes`` defaults to one per group."""
    x, y, _ = world
    xt, yt, kt = test
    groups = int(kt.max()) + 1
    net = sr.SoftRoutingNet(x.shape[1], 2, routes or groups, init_std=cfg.world_init_std,
                            generator=torch.Generator().manual_seed(seed), dtype=torch.float32)

    def gates():
        with torch.no_grad():
            return variant_outputs(net, xt, variant)[0]

    def group_information(r):
        return float(route_class_mutual_information(r, kt, groups)) if r.shape[1] > 1 else 0.0

    mi0 = group_information(gates())
    hist = train_variant(net, x, y, variant, epochs=cfg.world_epochs, batch_size=cfg.world_batch_size,
                            lr=cfg.world_lr, seed=seed, probe=(xt, yt))
    r = gates()
    metrics = {"accuracy": hist["accuracy"], "mean_gate_accuracy": mean_gate_accuracy(net, xt, yt, variant),
               "entropy0": hist["entropy"][0], "entropy": hist["entropy"][-1],
               "group_information0": mi0, "group_information": group_information(r)}
    return metrics, route_usage(route_distribution(r), kt, groups).numpy()


# ============================================================================= paper scale as experiment units
#
# Every training that chapter 3's figures and numbers rest on, at paper scale, as one unit per
# configuration and seed (see :mod:`capslib.book.units`):
#
# - ``03/routes/M<M>/s<k>``: the soft-routing network with M = 1, 2, 4, 8 routes, float64, trained by
#   gradient descent on the energy summed over each minibatch (autograd and ``torch.optim.SGD`` without
#   momentum, the update the chapter shows equal to its hand-coded one). Measured: test accuracy; route
#   use, routing entropy and route-class mutual information on the test digits; the mean routing weight
#   per class and route on the validation digits at initialisation and after every epoch. M = 4 is the
#   chapter's main network: with two routes or more a run also routes its trained votes by agreement
#   (the bridge to capsules) and measures the gradient shares of hand-set routing weights.
# - ``03/ablation/<variant>/s<k>``: the slides' network (M = 4, float32) and its four ablations
#   (:data:`VARIANTS`) on all the training digits: routing entropy, mutual
#   information and gate sum on the validation digits at initialisation and after every epoch.
#
# Schedule: every unit trains for UNIT_SCHEDULE["epochs"] epochs, fewer than the `full` profile's FULL_EPOCHS,
# so that each projects within 8 minutes on one H100 at the rate assumed for a network that has not
# been measured there yet (the step size, minibatch, initialisation and data are the `full` profile's).

_FULL = profiles.SIZES[CHAPTER]["full"]
# ``version`` counts changes to what the units' ``run`` or ``capslib.train.fit`` do that the probe
# cannot see (bump it with such a change: every chapter-3 result then reads stale).
UNIT_SCHEDULE = dict(version=1, dataset="mnist", split_seed=0, validation=5000, train_images=55_000, epochs=50,
                     batch_size=_FULL["batch_size"], lr=_FULL["lr"], init_std=_FULL["init_std"],
                     routing_init_std=_FULL["routing_init_std"],
                     optimizer="SGD without momentum on the energy summed over the minibatch",
                     in_use=0.05, bridge_patch=7, bridge_iterations=3, shares_digits=200, r_high=0.9, r_low=0.3,
                     eval_batch=5000)
FULL_EPOCHS = _FULL["epochs"]        # what the `full` profile trains (its notebook run on a GPU)
UNIT_ROUTES = tuple(_FULL["compare_routes"])
UNIT_MAIN_ROUTES = _FULL["routes"]
UNIT_SEEDS = tuple(range(_FULL["compare_seeds"]))
ABLATION_SEEDS = tuple(range(_FULL["ablation_seeds"]))
VARIANT_NAMES = {v: v.replace(" ", "-") for v in VARIANTS}     # "no r in eta" -> "no-r-in-eta"
UNIT_FAMILY = "softrouting785"   # the 785-input soft-routing network: no rate measured on an H100 yet
CLASSES = 10
# Smoke runs (CPU tests, rehearsals): the same code on the embedded digits, few of them, two epochs
UNIT_SMOKE = dict(dataset="embedded", epochs=2, train=300, val=100, test=100, shares_digits=50)


def _splits(unit: Unit, device: torch.device, smoke: bool, dtype: torch.dtype):
    """Train, validation and test digits on ``device``, flattened with the constant input appended."""
    cfg = unit.config
    splits = data.load(UNIT_SMOKE["dataset"] if smoke else cfg["dataset"], device=device, seed=cfg["split_seed"])
    tr, val, te = splits["train"], splits["val"], splits["test"]
    if smoke:
        tr, val, te = tr.subset(UNIT_SMOKE["train"]), val.subset(UNIT_SMOKE["val"]), te.subset(UNIT_SMOKE["test"])
    elif (len(tr), len(val)) != (cfg["train_images"], cfg["validation"]):
        raise ValueError(f"{unit.key}: expected {cfg['train_images']:,} training and {cfg['validation']:,} validation "
                         f"digits; got {len(tr):,} and {len(val):,} (a smoke setting in the environment?)")
    flat = lambda s: data.Split(sr.with_bias(s.x.to(dtype)), s.y)   # noqa: E731
    return flat(tr), flat(val), flat(te)


def _dtype(unit: Unit) -> torch.dtype:
    return {"float64": torch.float64, "float32": torch.float32}[unit.config["precision"]]


def unit_net(unit: Unit, d_in: int = 28 * 28 + 1, device=None, dtype: torch.dtype | None = None) -> sr.SoftRoutingNet:
    """The unit's untrained network: the chapter's initialisation (weights drawn from a generator seeded
    by the unit's seed, as ``make_net`` and ``ablation_net`` in the chapter draw them)."""
    cfg = unit.config
    return sr.SoftRoutingNet(d_in, CLASSES, cfg["routes"], init_std=cfg["init_std"],
                             routing_init_std=cfg["routing_init_std"],
                             generator=torch.Generator().manual_seed(unit.seed), dtype=dtype or _dtype(unit),
                             device=device)


def unit_energy(unit: Unit, model: sr.SoftRoutingNet, x: torch.Tensor, y: torch.Tensor):
    """The energy the unit minimises on a minibatch, summed over it, and the outputs that score it."""
    v = unit.config["variant"]
    r, Y, out = variant_outputs(model, x, v)
    return variant_energy(r, Y, out, sr.one_hot(y, CLASSES, dtype=out.dtype), v), out


def unit_predict(unit: Unit):
    """The outputs that score a digit, ``predict(model, x)``, as the unit's variant computes them."""
    return lambda model, x: variant_outputs(model, x, unit.config["variant"])[2]


def unit_fit(unit: Unit, net: sr.SoftRoutingNet, tr: data.Split, epochs: int, loss_fn=None, val: data.Split | None = None,
             on_epoch_end=None, progress: bool = True) -> dict:
    """Train ``net`` as the unit does: ``capslib.train.fit`` with plain gradient descent (SGD without
    momentum, step ``lr``) on the energy summed over each minibatch of a permutation seeded by the unit's
    seed, the chapter's ``train_gd`` and ``train_variant`` computed by autograd."""
    cfg = unit.config
    loss_fn = loss_fn or (lambda model, x, y: unit_energy(unit, model, x, y))
    return train.fit(net, tr, loss_fn, epochs=epochs, batch_size=cfg["batch_size"],
                     optimizer=torch.optim.SGD(net.parameters(), lr=cfg["lr"]), val=val, predict=unit_predict(unit),
                     seed=unit.seed, amp=False, progress=progress, on_epoch_end=on_epoch_end,
                     eval_batch_size=cfg["eval_batch"], desc=unit.key)


def unit_probe(unit: Unit) -> dict:
    """One training step of the unit's network at full size in float64 on the CPU (weights drawn from
    seed 0, four seeded random digits, the unit's variant with its start and energy): the energy and the
    gradient norms of R and P."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    cfg = unit.config
    net = sr.SoftRoutingNet(28 * 28 + 1, CLASSES, cfg["routes"], init_std=cfg["init_std"],
                            routing_init_std=cfg["routing_init_std"], generator=g, dtype=torch.float64)
    x = sr.with_bias(torch.rand(4, 1, 28, 28, generator=g, dtype=torch.float64))
    y = torch.tensor([0, 3, 7, 9])
    if cfg["variant"] == "gates sum to 1":
        init_gates_sum_to_one(net, x)
    loss, _ = unit_energy(unit, net, x, y)
    loss.backward()
    return {"energy": loss.item(), "x_sum": x.sum().item(), "grad:R": net.R.grad.norm().item(),
            "grad:P": net.P.grad.norm().item()}


@torch.no_grad()
def _mixing(model: sr.SoftRoutingNet, x: torch.Tensor, y: torch.Tensor, variant: str) -> dict:
    """Route use per class (C, M), routing entropy and route-class mutual information (bits), gate sum."""
    r, _, _ = variant_outputs(model, x, variant)
    return {"usage": route_usage(r, y, CLASSES), "entropy": float(routing_entropy(r)),
            "mi": float(route_class_mutual_information(r, y, CLASSES)), "gate_sum": float(r.sum(dim=1).mean())}


@torch.no_grad()
def _initial_gate_error(model: sr.SoftRoutingNet, x: torch.Tensor, y: torch.Tensor, variant: str) -> dict:
    """What the first steps start from (Eq. ch3-gr): the share of (digit, route) pairs with g(j) > 0, its
    mean, and the mean route output."""
    r, Y, _ = variant_outputs(model, x, variant)
    g = sr.error_signals(r, Y, sr.one_hot(y, CLASSES, dtype=Y.dtype)).g_r
    return {"g_positive": float((g > 0).to(torch.float64).mean()), "g_mean": float(g.mean()),
            "route_output_mean": float(Y.mean())}


@torch.no_grad()
def _bridge(model: sr.SoftRoutingNet, x: torch.Tensor, y: torch.Tensor, patch: int, iterations: int,
            used: list[int]) -> tuple[dict, dict]:
    """The chapter's bridge to capsules on the test digits: the trained routes' votes per image patch
    (Eq. ch3-votes) routed by agreement, against the learned gate's shares; the correlation of the two
    shares across the digits within each route in ``used``."""
    from ..routing import routing_trace

    side = 28
    pix = torch.arange(side * side, device=x.device).view(side, side)
    patches = [pix[a:a + patch, b:b + patch].flatten() for a in range(0, side, patch) for b in range(0, side, patch)]
    patches.append(torch.tensor([side * side], device=x.device))      # the constant input
    P = model.P.detach()
    u_hat = torch.stack([torch.einsum("moi,ni->nmo", P[:, :, idx], x[:, idx]) for idx in patches], dim=1)
    cs, _ = routing_trace(u_hat, iterations=iterations)
    agreement = cs[-1].mean(dim=1)                                          # (N, M)
    learned = route_distribution(model.routing(x))                       # (N, M)
    a, q = agreement.double().cpu().numpy(), learned.double().cpu().numpy()
    metrics = {
        "pooled_correlation": float(np.corrcoef(a.ravel(), q.ravel())[0, 1]),
        "same_top": float((agreement.argmax(1) == learned.argmax(1)).double().mean()),
        "gate_top": float(learned.max(1).values.mean()), "agreement_top": float(agreement.max(1).values.mean()),
        "gate_mi": float(route_class_mutual_information(learned, y, CLASSES)),
        "agreement_mi": float(route_class_mutual_information(agreement, y, CLASSES)),
        "within_route_correlation": {str(j + 1): float(np.corrcoef(a[:, j], q[:, j])[0, 1]) for j in used},
        "patches": len(patches), "iterations": iterations,
    }
    arrays = {"learned_share_by_class": encode_array(route_usage(learned, y, CLASSES)),
              "agreement_share_by_class": encode_array(route_usage(agreement, y, CLASSES)),
              "couplings_digit0": encode_array(torch.stack([c[0] for c in cs])),        # (iterations, patches, M)
              "label_digit0": encode_array(y[:1], "int64")}
    return metrics, arrays


@torch.no_grad()
def _gradient_shares(P0: torch.Tensor, P1: torch.Tensor, x: torch.Tensor, y: torch.Tensor, favourite: int,
                     ignored: list[int], r_high: float, r_low: float) -> dict:
    """The chapter's hand-set routing weights: each route's share of the routing weight and of the
    gradient, with the favourite route (then the first ignored one) at ``r_high`` and the others at ``r_low``."""
    t = sr.one_hot(y, CLASSES, dtype=x.dtype)
    M = P0.shape[0]

    def r_with(j_high):
        return torch.tensor([r_high if j == j_high else r_low for j in range(M)], dtype=x.dtype, device=x.device)

    def gap(P, r):
        n = sr.route_gradient_norms(P, x, t, r)
        return float(((r / r.sum()) - n / n.sum()).abs().max()), n / n.sum()

    gap_init, _ = gap(P0, r_with(favourite))
    gap_trained, _ = gap(P1, r_with(favourite))
    Y = torch.sigmoid(torch.einsum("moi,ni->nmo", P1, x))
    slope = (Y * (1 - Y)).mean(dim=(0, 2))
    out = {"digits": len(y), "gap_initial": gap_init, "gap_trained": gap_trained, "slope_favourite": float(slope[favourite])}
    if ignored:
        _, raised = gap(P1, r_with(ignored[0]))
        out.update(slope_ignored_min=float(slope[ignored].min()), raised_share=float(raised[ignored[0]]),
                   raised_favourite_share=float(raised[favourite]))
    return out


def unit_run(unit: Unit, device: torch.device, smoke: bool) -> dict:
    """Train the unit's network (see the notes above the unit declarations) and measure it."""
    cfg = unit.config
    variant, dtype = cfg["variant"], _dtype(unit)
    if device.type == "cuda":      # float32 means float32: no TF32 products
        torch.backends.cuda.matmul.allow_tf32 = False
    tr, val, te = _splits(unit, device, smoke, dtype)
    epochs = UNIT_SMOKE["epochs"] if smoke else cfg["epochs"]
    torch.manual_seed(unit.seed)
    net = unit_net(unit, tr.x.shape[1], device=device, dtype=dtype)
    if variant == "gates sum to 1":
        init_gates_sum_to_one(net, tr.x)      # on the training inputs, as train_variant does
    P0 = net.P.detach().clone()
    start = _mixing(net, val.x, val.y, variant)
    start_g = _initial_gate_error(net, val.x, val.y, variant)
    usage = [start["usage"]]
    energy_sum = torch.zeros((), dtype=torch.float64, device=device)

    def loss_fn(model, x, y):
        nonlocal energy_sum
        E, out = unit_energy(unit, model, x, y)
        energy_sum = energy_sum + E.detach().double()
        return E, out.detach()

    def record(epoch, model, history):     # after every epoch, on the validation digits
        nonlocal energy_sum
        history.setdefault("energy_per_digit", []).append(float(energy_sum) / len(tr))
        energy_sum = torch.zeros_like(energy_sum)
        mix = _mixing(model, val.x, val.y, variant)
        usage.append(mix["usage"])
        for k in ("entropy", "mi", "gate_sum"):
            history.setdefault(f"val_{k}", []).append(mix[k])

    history = unit_fit(unit, net, tr, epochs, loss_fn, val=val, on_epoch_end=record)
    acc = train.evaluate(net, te, batch_size=cfg["eval_batch"], predict=unit_predict(unit))
    M = cfg["routes"]
    metrics = {
        "test_accuracy": acc, "test_error": 1 - acc, "test_images": len(te),
        "test_binomial_se": math.sqrt(acc * (1 - acc) / len(te)),
        "final_val_accuracy": history["val_acc"][-1], "epochs": epochs, "train_images": len(tr),
        "routes": M, "log2_routes": math.log2(M), "params": sum(p.numel() for p in net.parameters()),
        "initial": {"entropy_bits": start["entropy"], "mutual_information_bits": start["mi"],
                    "gate_sum": start["gate_sum"], **start_g},
        "final_val_entropy_bits": history["val_entropy"][-1], "final_val_mutual_information_bits": history["val_mi"][-1],
        "entropy_drop_epoch1_bits": start["entropy"] - history["val_entropy"][0],
        "images_per_s_median": float(np.median(history["images_per_s"])),
        "seconds_per_epoch_median": train.seconds_per_epoch(history),
    }
    with torch.no_grad():
        r_test = variant_outputs(net, te.x, variant)[0]
    mean_r = r_test.mean(dim=0)
    in_use = mean_r > cfg["in_use"]
    metrics["test_mixing"] = {"routes_in_use": int(in_use.sum()), "entropy_bits": float(routing_entropy(r_test)),
                              "mutual_information_bits": float(route_class_mutual_information(r_test, te.y, CLASSES)),
                              "mean_r": [float(v) for v in mean_r]}
    arrays = {"usage_by_epoch": encode_array(torch.stack(usage))}      # (epochs + 1, C, M), validation digits
    start_top, final_top = int(usage[0].mean(0).argmax()), int(usage[-1].mean(0).argmax())
    metrics["top_route"] = {"initial": start_top + 1, "final": final_top + 1}
    growth = net.P.detach().flatten(1).norm(dim=1) / P0.flatten(1).norm(dim=1)
    favourite = int(mean_r.argmax())
    ignored = [j for j in range(M) if not bool(in_use[j])]
    metrics["weight_growth"] = {"favourite": float(growth[favourite]),
                                "ignored_max": float(growth[ignored].max()) if ignored else None}
    if variant == "slides" and M >= 2 and dtype == torch.float64:
        used = [j for j in range(M) if bool(in_use[j])]
        m, a = _bridge(net, te.x, te.y, cfg["bridge_patch"], cfg["bridge_iterations"], used)
        metrics["bridge"] = m
        arrays.update(a)
        n = UNIT_SMOKE["shares_digits"] if smoke else cfg["shares_digits"]
        metrics["gradient_shares"] = _gradient_shares(P0, net.P.detach(), te.x[:n], te.y[:n], favourite, ignored,
                                                      cfg["r_high"], cfg["r_low"])
    hist = {k: v for k, v in history.items() if isinstance(v, list)}
    return {"metrics": metrics, "history": hist, "arrays": arrays}


def _unit_config(routes: int, variant: str, precision: str) -> dict:
    return {**UNIT_SCHEDULE, "routes": routes, "variant": variant, "precision": precision,
            "tf32": False}


def _register_units() -> None:
    images = UNIT_SCHEDULE["epochs"] * UNIT_SCHEDULE["train_images"]
    order = [UNIT_MAIN_ROUTES] + [M for M in UNIT_ROUTES if M != UNIT_MAIN_ROUTES]   # the main network first
    for s in UNIT_SEEDS:
        for i, M in enumerate(order):
            register(Unit("03", f"routes/M{M}", s, unit_run, _unit_config(M, "slides", "float64"), unit_probe,
                          UNIT_FAMILY, images, 10 + 10 * s + i,
                          f"soft routing with M = {M} route{'s' * (M > 1)}: test accuracy, route use, entropy, "
                          f"mutual information" + ("; agreement bridge, gradient shares" if M >= 2 else "")))
    for s in ABLATION_SEEDS:
        for i, v in enumerate(VARIANTS):
            register(Unit("03", f"ablation/{VARIANT_NAMES[v]}", s, unit_run,
                          _unit_config(UNIT_MAIN_ROUTES, v, "float32"), unit_probe, UNIT_FAMILY, images,
                          14 + 10 * s + i, f"ablation '{v}' (M = {UNIT_MAIN_ROUTES}, float32): entropy and "
                                           f"mutual information by epoch"))


_register_units()


def _declare_paper_scale() -> None:
    """The rows of the chapter's comparison table that the main units measure (no paper number: the slides
    report none)."""
    from .units import paper_scale

    paper_scale(f"MNIST test accuracy, M = {UNIT_MAIN_ROUTES}", f"03/routes/M{UNIT_MAIN_ROUTES}",
                lambda m: m["test_accuracy"], ".4f", row=True)
    paper_scale("test accuracy of M routes minus a single route's", f"03/routes/M{UNIT_MAIN_ROUTES}",
                lambda m: m["test_accuracy"], "+.4f", row=True, what=f"M = {UNIT_MAIN_ROUTES}, paired:",
                baseline="03/routes/M1")
    paper_scale("route mixing: I(route; class)", f"03/routes/M{UNIT_MAIN_ROUTES}",
                lambda m: m["test_mixing"]["mutual_information_bits"], ".3f", row=True)


_declare_paper_scale()


# ----------------------------------------------------------------------------- the chapter's paper-scale views

#: the variants as a reader sees them in tables and sentences (plain text: no TeX outside figures)
READER_NAMES = {"slides": "the slides' network", "no r in eta": "no r(j) in η", "softmax gate": "softmax gate",
                "competitive error": "competitive error", "gates sum to 1": "gates sum to 1"}
#: the same in figure legends, where matplotlib sets TeX
ABLATION_LABELS = {**READER_NAMES, "no r in eta": "no $r$ in $\\eta$"}


def routes_groups(smoke: bool = False):
    """The route comparison's results, one group per route count M (each over its seeds)."""
    from .units import group
    return [group(f"03/routes/M{M}", f"M = {M} route{'s' * (M > 1)}", smoke) for M in UNIT_ROUTES]


def ablation_groups(smoke: bool = False):
    """The ablations' results, one group per variant (the slides' network first)."""
    from .units import group
    return [group(f"03/ablation/{VARIANT_NAMES[v]}", f"the ablation '{v}'", smoke) for v in VARIANTS]



def _by_seed(g, get) -> dict:
    return {r["seed"]: float(get(r)) for r in g.results}


def routes_frame(groups):
    """The route comparison at paper scale: per route count, mean ± SD over the seeds run of the test
    accuracy, its paired difference to the smallest route count, and the routes' use on the test digits."""
    import pandas as pd

    base = _by_seed(groups[0], lambda r: r["metrics"]["test_accuracy"])
    rows = []
    for M, g in zip(UNIT_ROUTES, groups):
        acc = _by_seed(g, lambda r: r["metrics"]["test_accuracy"])
        both = sorted(set(acc) & set(base))
        mix = lambda k: [r["metrics"]["test_mixing"][k] for r in g.results]   # noqa: E731
        rows.append((f"M = {M}", M * (CLASSES + 1) * (28 * 28 + 1), seed_spread(list(acc.values()), ".4f"),
                     "–" if M == UNIT_ROUTES[0] else seed_spread([acc[s] - base[s] for s in both], "+.4f").replace("not yet run", "–"),
                     seed_spread(mix("routes_in_use"), ".1f").replace("not yet run", "–"),
                     seed_spread(mix("entropy_bits"), ".2f").replace("not yet run", "–"), f"{math.log2(M):.0f}",
                     seed_spread(mix("mutual_information_bits"), ".3f").replace("not yet run", "–"), len(g.results)))
    cols = ["parameters", "test accuracy", f"minus M = {UNIT_ROUTES[0]} (same seed)", "routes in use",
            "routing entropy (bits)", "log2 M (bits)", "I(route; class) (bits)", "seeds"]
    return pd.DataFrame(rows, columns=["routes", *cols]).set_index("routes")


def ablation_frame(groups):
    """The ablations at paper scale: per variant, mean ± SD over the seeds run, on the validation digits."""
    import pandas as pd

    rows = []
    for v, g in zip(VARIANTS, groups):
        m = lambda k: [r["metrics"][k] for r in g.results]   # noqa: E731
        cells = [seed_spread(m("entropy_drop_epoch1_bits"), ".2f"), seed_spread(m("final_val_entropy_bits"), ".2f"),
                 seed_spread(m("final_val_mutual_information_bits"), ".3f"), seed_spread(m("test_accuracy"), ".4f")]
        if g.results:
            cells = [c if c != "not yet run" else "–" for c in cells]
        else:
            cells = ["not yet run"] + ["–"] * 3
        rows.append((READER_NAMES[v], *cells, len(g.results)))
    return pd.DataFrame(rows, columns=["variant", "entropy lost in epoch 1 (bits)", "final entropy (bits)",
                                       "final I(route; class) (bits)", "test accuracy", "seeds"]).set_index("variant")


def _seeds_words(n: int) -> str:
    return "one seed" if n == 1 else f"mean of {n} seeds"


def _main_runs(groups) -> tuple[list, int]:
    """The main network's paper-scale results (by seed) and in how many of them one route carries the test
    digits."""
    main = sorted(groups[UNIT_ROUTES.index(UNIT_MAIN_ROUTES)].results, key=lambda r: r["seed"])
    return main, sum(r["metrics"]["test_mixing"]["routes_in_use"] == 1 for r in main)


def paper_scale_summary(groups) -> str:
    """What the main network (``M = UNIT_MAIN_ROUTES``) does at paper scale, and what more routes buy, in
    one sentence from the ``03/routes`` results: test accuracy, in how many seeds one route carries the
    test digits, the largest routing entropy and mutual information over the seeds, in how many seeds the
    surviving route is the one whose mean gate was largest at initialisation, and the accuracy of the most
    routes minus one route's, paired by seed."""
    from .stats import summarise

    main, one = _main_runs(groups)
    if not main:
        return "no paper-scale run of the main network has been made yet, so this section says nothing about it"
    n = len(main)
    m = [r["metrics"] for r in main]
    acc = summarise([x["test_accuracy"] for x in m])
    same_top = sum(x["top_route"]["initial"] == x["top_route"]["final"] for x in m)
    H = max(x["test_mixing"]["entropy_bits"] for x in m)
    MI = max(x["test_mixing"]["mutual_information_bits"] for x in m)
    carried = ("a single route carries the test digits" if n == 1 and one == 1 else
               "in every seed a single route carries the test digits" if one == n else
               f"in {one} of {n} seeds a single route carries the test digits")
    text = (f"on all {UNIT_SCHEDULE['train_images']:,} training digits for {UNIT_SCHEDULE['epochs']} epochs the "
            f"network with M = {UNIT_MAIN_ROUTES} routes reaches {acc.mean:.2%} test accuracy "
            f"({_seeds_words(n)}), and {carried} (over the seeds, the routing entropy on the test digits is at "
            f"most {H:.3f} of {math.log2(UNIT_MAIN_ROUTES):.0f} bits and I(route; class) at most {MI:.3f} bits); "
            f"in {same_top} of {n} seeds the route used most at the end is the one whose mean gate was largest "
            f"at initialisation")
    base = _by_seed(groups[0], lambda r: r["metrics"]["test_accuracy"])
    most = _by_seed(groups[-1], lambda r: r["metrics"]["test_accuracy"])
    both = sorted(set(base) & set(most))
    if both:
        d = [most[s] - base[s] for s in both]
        text += (f". With M = {UNIT_ROUTES[-1]} routes the test accuracy differs from one route's by "
                 f"{100 * np.mean(d):+.2f} percentage points (paired by seed, higher in "
                 f"{sum(v > 0 for v in d)} and lower in {sum(v < 0 for v in d)} of {len(d)} seeds)")
    return text


def paper_scale_short(groups) -> str:
    """The main network's collapse at paper scale in a few words (the chapter's summary)."""
    main, one = _main_runs(groups)
    if not main:
        return "no paper-scale run of the main network has been made yet"
    n = len(main)
    where = "in every one of its seeds" if one == n and n > 1 else f"in {one} of {n} seed{'s' * (n > 1)}"
    return (f"trained on all the training digits, the network with M = {UNIT_MAIN_ROUTES} routes sends the test "
            f"digits through a single route {where}")


def ablation_summary(groups) -> str:
    """The ablations at paper scale in one sentence: each variant's final routing entropy on the validation
    digits minus the slides' network's, paired by seed and read against the margin declared in the `full`
    profile before the runs (:class:`capslib.book.stats.Equivalence`), with the competitive error's mutual
    information."""
    from .stats import Equivalence, summarise

    get = lambda g: _by_seed(g, lambda r: r["metrics"]["final_val_entropy_bits"])   # noqa: E731
    slides = get(groups[0])
    if not slides:
        return "no paper-scale run of the ablations has been made yet"
    margin = _FULL["ablation_margin"]
    said = []
    for v, g in zip(VARIANTS[1:], groups[1:]):
        other = get(g)
        both = sorted(set(slides) & set(other))
        if len(both) < 2:
            said.append(f"{READER_NAMES[v]}: {len(both)} paired seed(s), too few to compare")
            continue
        eq = Equivalence(summarise([other[s] - slides[s] for s in both], both), margin)
        said.append(f"{READER_NAMES[v]} ends at {np.mean([other[s] for s in both]):.2f} bits, "
                    f"{eq.phrase('.1f')}")
    comp = _by_seed(groups[VARIANTS.index("competitive error")],
                    lambda r: r["metrics"]["final_val_mutual_information_bits"])
    tail = (f"; the competitive error's routes carry at most {max(comp.values()):.3f} bits about the class"
            if comp else "")
    return (f"after {UNIT_SCHEDULE['epochs']} epochs the slides' network keeps "
            f"{np.mean(list(slides.values())):.3f} bits of routing entropy on the validation digits "
            f"({_seeds_words(len(slides))}); against it, with the margin of ±{margin:.1f} bits declared before "
            f"the runs: " + "; ".join(said) + tail)


def _curves(result: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Epochs (0 = initialisation), routing entropy and mutual information on the validation digits."""
    m, h = result["metrics"], result["history"]
    H = np.array([m["initial"]["entropy_bits"], *h["val_entropy"]])
    MI = np.array([m["initial"]["mutual_information_bits"], *h["val_mi"]])
    return np.arange(len(H)), H, MI


def draw_mixing(result: dict):
    """Mean routing weight per class and route on the validation digits, at initialisation and after
    epochs 1, 2, 5 and the last, from a ``03/routes`` result."""
    from .units import decode_array

    usage = decode_array(result["arrays"]["usage_by_epoch"])
    last = len(usage) - 1
    shown = sorted({e for e in (1, 2, 5, last) if 1 <= e <= last})
    return route_heatmaps([usage[0]] + [usage[e] for e in shown],
                          ["initialisation"] + [f"after epoch {e}" for e in shown],
                          xlabel="route $j$", ylabel="class $c$", cbar_label="mean $r(j)$",
                          suptitle=f"Mean $r(j)$ per class, $M = {result['metrics']['routes']}$ (validation digits)")


def draw_bridge(result: dict):
    """Route shares per class on the test digits: the learned gate's q(j) beside the agreement couplings'
    mean over the patches, from a ``03/routes`` result with two routes or more."""
    from .units import decode_array

    a = result["arrays"]
    n = result["metrics"]["bridge"]["patches"]
    return route_heatmaps([decode_array(a["learned_share_by_class"]), decode_array(a["agreement_share_by_class"])],
                          ["learned gate:\n$q(j) = r(j) / \\sum_k r(k)$", f"agreement:\n$\\frac{{1}}{{{n}}}\\sum_i c_{{ij}}$"],
                          xlabel="route $j$", ylabel="class $c$", cbar_label="mean share",
                          suptitle=f"Route shares per class, $M = {result['metrics']['routes']}$ (test digits)")


def draw_routes(groups):
    """Test accuracy against the parameters of M routes (each seed a point, the mean over seeds a line),
    and the routing entropy on the test digits against its ceiling log2 M."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN

    fig, axes = plt.subplots(1, 2, figsize=(COLUMN_IN, 3.4), layout="constrained")
    params, means, Ms, H, MI = [], [], [], [], []
    for M, g in zip(UNIT_ROUTES, groups):
        if not g.results:
            continue
        acc = [r["metrics"]["test_accuracy"] for r in g.results]
        p = g.results[0]["metrics"]["params"]
        axes[0].scatter([p] * len(acc), acc, s=12, color="gray", alpha=0.6, zorder=3)
        params.append(p)
        means.append(float(np.mean(acc)))
        Ms.append(M)
        H.append(float(np.mean([r["metrics"]["test_mixing"]["entropy_bits"] for r in g.results])))
        MI.append(float(np.mean([r["metrics"]["test_mixing"]["mutual_information_bits"] for r in g.results])))
    if not Ms:
        raise ValueError("draw_routes needs at least one result of the route comparison")
    axes[0].plot(params, means, "o-", label="mean over seeds")
    for p, m, M in zip(params, means, Ms):
        axes[0].annotate(f"$M={M}$", (p, m), textcoords="offset points", xytext=(4, 4), fontsize=9)
    axes[0].set_xscale("log")
    axes[0].set_xticks(params, [f"{p / 1000:.0f}k" if p >= 10_000 else f"{p / 1000:.1f}k" for p in params])
    axes[0].minorticks_off()                 # the log axis's own labels crowd each other between the counts
    axes[0].set_xlabel("parameters")
    axes[0].set_ylabel("test accuracy")
    axes[0].legend(fontsize=9, loc="upper left")     # the seeds of the largest M sit at the lower right
    grid = np.array(UNIT_ROUTES)
    axes[1].plot(grid, np.log2(grid), "--", color="gray", lw=0.8, label="$\\log_2 M$")
    axes[1].plot(Ms, H, "o-", label="$H(q)$")
    axes[1].plot(Ms, MI, "s-", label="$I(j;\\,c)$")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xticks(grid, [str(M) for M in grid])
    axes[1].set_xlabel("routes $M$")
    axes[1].set_ylabel("bits (test digits)")
    axes[1].legend(fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig


def draw_ablation(groups):
    """Routing entropy and route-class mutual information over the epochs for each variant with results:
    the mean over its seeds as a line, and after the last epoch a bar from the lowest to the highest seed
    (bands over the whole run overlap into one another with five variants)."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN

    fig, axes = plt.subplots(1, 2, figsize=(COLUMN_IN, 3.8), layout="constrained")
    drawn, last = 0, 0
    for k, (v, g) in enumerate(zip(VARIANTS, groups)):
        if not g.results:
            continue
        curves = [_curves(r) for r in g.results]
        ep = curves[0][0]
        last = max(last, ep[-1])
        for ax, i in zip(axes, (1, 2)):
            c = np.array([cv[i] for cv in curves])
            ax.plot(ep, c.mean(0), "-", color=f"C{k}", label=f"{ABLATION_LABELS[v]} ({len(curves)} seed{'s' * (len(curves) > 1)})")
            end = ep[-1] + (1 + k) * max(1, len(ep) // 40)               # side by side after the last epoch
            ax.errorbar([end], [c[:, -1].mean()], yerr=[[c[:, -1].mean() - c[:, -1].min()],
                                                        [c[:, -1].max() - c[:, -1].mean()]],
                        fmt="o", ms=3, color=f"C{k}", capsize=2, lw=1)
        drawn += 1
    if not drawn:
        raise ValueError("draw_ablation needs at least one result of the ablations")
    axes[0].axhline(math.log2(UNIT_MAIN_ROUTES), color="gray", ls="--", lw=0.8)
    axes[0].set_ylabel("$H(q)$ (bits)")
    axes[1].set_ylabel("$I(j;\\,c)$ (bits)")
    for ax in axes:
        ax.set_xlabel("epoch (0 = initialisation)")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_xticks([x for x in ax.get_xticks() if 0 <= x <= last])     # no epoch numbers under the bars
        ax.grid(alpha=0.3)
    fig.suptitle("lines: mean over the seeds; bars: lowest to highest seed after the last epoch", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=9)
    return fig
