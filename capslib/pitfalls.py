"""Routing-by-agreement as coordinate ascent, and two pitfalls of public CapsNet code (chapter 2).

The agreement objective (chapter 2, "Routing as coordinate ascent")::

    G(c, v) = sum_ij c_ij <u_hat_{j|i}, v_j> - sum_j R(||v_j||) + sum_i H(c_i)

with ``H(c_i) = -sum_j c_ij log c_ij`` (each ``c_i`` on the simplex over the parents ``j``) and
``R(rho) = arcsin(sqrt(rho)) - sqrt(rho (1 - rho))`` on ``[0, 1)``. Its maximiser in ``c`` for fixed
``v`` is ``softmax_j <u_hat_{j|i}, v_j>``; its maximiser in ``v`` for fixed ``c`` is
``squash(sum_i c_ij u_hat_{j|i})`` (``R'(rho) = sqrt(rho / (1 - rho))`` inverts the squash's length map
``n -> n^2 / (1 + n^2)``). :func:`ascent_routing` alternates the two exactly; Procedure 1 of Sabour et
al. (:func:`capslib.dynamic_routing`) instead accumulates the agreements in the logits.

The pitfalls are switches of :func:`routing` (never the default):

* ``softmax_over="inputs"``: the coupling softmax taken over the input capsules ``i`` instead of the
  parents ``j`` (then ``sum_i c_ij = 1`` and ``sum_j c_ij`` is not 1: chapter 2's Eq. ch2-softmax is
  violated);
* ``squash_eps=False``: the squash evaluated as the literal quotient of Eq. ch1-squash, which is
  0/0 = NaN at ``s = 0`` (the function's limit there is 0).

:func:`capsnet` builds chapter 2's CapsNet with either switch (in the routing and, for the squash, in
the primary capsules too).
"""
from __future__ import annotations

import functools

import torch

from .checks import check_positive_int, check_tensor
from .layers import PrimaryCaps
from .ops import squash

SOFTMAX_OVER = ("parents", "inputs")


def squash_no_eps(s: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The squash as a literal quotient, ``n^2 / (1 + n^2) * s / n`` with ``n = ||s||`` and no guard:
    NaN (0/0) wherever ``s = 0`` (a pitfall; :func:`capslib.squash` is the guarded one)."""
    check_tensor("s", s, min_dim=1)
    n2 = (s * s).sum(dim=dim, keepdim=True)
    n = torch.sqrt(n2)
    return n2 / (1.0 + n2) * s / n


def squash_fn(squash_eps: bool = True):
    """:func:`capslib.squash` (``squash_eps=True``) or :func:`squash_no_eps`."""
    if not isinstance(squash_eps, bool):
        raise TypeError(f"squash_eps must be True or False; got {squash_eps!r}")
    return squash if squash_eps else squash_no_eps


def _check_softmax_over(softmax_over):
    if softmax_over not in SOFTMAX_OVER:
        raise ValueError(f"softmax_over must be one of {SOFTMAX_OVER}; got {softmax_over!r}")
    return 2 if softmax_over == "parents" else 1


def routing(u_hat: torch.Tensor, iterations: int = 3, detach: bool = False, *,
            softmax_over: str = "parents", squash_eps: bool = True):
    """Procedure 1 with the two pitfalls as switches. With the defaults it computes exactly what
    :func:`capslib.dynamic_routing` computes.

    Args:
        u_hat: votes ``(B, I, J, D)``.
        iterations: routing iterations ``r >= 1``.
        detach: must be False (the pitfalls are studied with the gradient through the couplings).
        softmax_over: ``"parents"`` (Eq. ch2-softmax: each input capsule distributes one unit over
            its parents) or ``"inputs"`` (the pitfall: each parent distributes one unit over its
            input capsules).
        squash_eps: False evaluates the squash without a guard (:func:`squash_no_eps`).

    Returns:
        ``(v (B, J, D), c (B, I, J))`` as :func:`capslib.dynamic_routing`.
    """
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
    check_positive_int("iterations", iterations)
    if detach:
        raise ValueError("routing: detach=True is not supported here (chapter 4 studies it)")
    axis = _check_softmax_over(softmax_over)
    sq = squash_fn(squash_eps)
    b = u_hat.new_zeros(u_hat.shape[:3])
    for t in range(iterations):
        c = torch.softmax(b, dim=axis)
        v = sq(torch.einsum("bij,bijd->bjd", c, u_hat))
        if t < iterations - 1:
            b = b + torch.einsum("bijd,bjd->bij", u_hat, v)
    return v, c


def routing_fn(softmax_over: str = "parents", squash_eps: bool = True):
    """A ``routing_fn(u_hat, iterations, detach)`` for :class:`capslib.layers.DenseCaps`."""
    _check_softmax_over(softmax_over)
    squash_fn(squash_eps)
    return functools.partial(routing, softmax_over=softmax_over, squash_eps=squash_eps)


VARIANTS = {
    "correct": dict(softmax_over="parents", squash_eps=True),
    "softmax over inputs": dict(softmax_over="inputs", squash_eps=True),
    "squash without epsilon": dict(softmax_over="parents", squash_eps=False),
}


def capsnet(variant: str = "correct", **kwargs):
    """Chapter 2's :class:`capslib.models.CapsNet` (``kwargs`` as there) with one of :data:`VARIANTS`:
    the routing of :func:`routing` with its switches and, for ``"squash without epsilon"``, the
    unguarded squash in the primary capsules as well."""
    from . import models

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}; got {variant!r}")
    net = models.CapsNet(**kwargs)
    switches = VARIANTS[variant]
    net.digit.routing_fn = routing_fn(**switches)
    if not switches["squash_eps"]:
        net.primary.__class__ = PrimaryCapsNoEps  # same weights, unguarded squash
    return net


class PrimaryCapsNoEps(PrimaryCaps):
    """:class:`capslib.layers.PrimaryCaps` whose squash has no guard at ``s = 0`` (the pitfall)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.conv(x)
        B, _, H, W = u.shape
        u = u.view(B, self.types, self.dim, H, W).permute(0, 1, 3, 4, 2)
        return squash_no_eps(u.reshape(B, self.types * H * W, self.dim))


# --- routing as coordinate ascent ------------------------------------------------------------------

def length_penalty(rho: torch.Tensor) -> torch.Tensor:
    """``R(rho) = arcsin(sqrt(rho)) - sqrt(rho (1 - rho))`` for lengths ``0 <= rho < 1``: the convex
    penalty whose derivative ``sqrt(rho / (1 - rho))`` inverts the squash's length map."""
    if not torch.is_tensor(rho):
        rho = torch.as_tensor(rho, dtype=torch.float64)
    if bool(((rho < 0) | (rho >= 1)).any()):
        raise ValueError("length_penalty: lengths must lie in [0, 1)")
    return torch.asin(torch.sqrt(rho)) - torch.sqrt(rho * (1 - rho))


def objective(u_hat: torch.Tensor, c: torch.Tensor, v: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``G(c, v)`` per example ``(B,)``: agreement ``sum_ij c_ij <u_hat_{j|i}, v_j>`` minus
    ``sum_j R(||v_j||)`` plus ``temperature * sum_i H(c_i)`` (entropy over the parents)."""
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
    check_tensor("c", c, dims=3, floating=True, shape_doc="(B, I, J)")
    check_tensor("v", v, dims=3, floating=True, shape_doc="(B, J, D)")
    if c.shape != u_hat.shape[:3] or v.shape != (u_hat.shape[0], u_hat.shape[2], u_hat.shape[3]):
        raise ValueError(f"shapes do not match: u_hat {tuple(u_hat.shape)}, c {tuple(c.shape)}, v {tuple(v.shape)}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0; got {temperature!r}")
    agreement = torch.einsum("bij,bijd,bjd->b", c, u_hat, v)
    entropy = -(torch.special.xlogy(c, c)).sum(dim=(1, 2))
    return agreement - length_penalty(v.norm(dim=-1)).sum(dim=1) + temperature * entropy


def ascent_routing(u_hat: torch.Tensor, iterations: int = 3):
    """Exact coordinate ascent on :func:`objective` (temperature 1), started like Procedure 1 from
    uniform couplings: ``v = squash(sum_i c_ij u_hat_{j|i})``, then ``c_i = softmax_j <u_hat_{j|i}, v_j>``
    (the current agreements, not their running sum). Returns lists ``cs``, ``vs`` of length
    ``iterations`` (the couplings used in, and the output of, every iteration), without a graph."""
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
    check_positive_int("iterations", iterations)
    cs, vs = [], []
    with torch.no_grad():
        c = torch.full(u_hat.shape[:3], 1.0 / u_hat.shape[2], dtype=u_hat.dtype, device=u_hat.device)
        for _ in range(iterations):
            v = squash(torch.einsum("bij,bijd->bjd", c, u_hat))
            cs.append(c)
            vs.append(v)
            c = torch.softmax(torch.einsum("bijd,bjd->bij", u_hat, v), dim=2)
    return cs, vs

