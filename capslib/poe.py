"""Products of expert capsules trained by contrastive divergence (Hauser 2019; chapter 7).

A squashed capsule's length is read as the probability that a binary "on" unit
fires, which turns a capsule layer into an RBM-like product of experts:

* energy (Eq. 7) ``E(x, h) = -sum_j h_j log ||z_j||^2`` with ``z_j = sum_i c_ij W_ij x_i``;
* free energy (Eq. 10, up to ``log Z``) ``F(x) = -sum_j log(1 + ||z_j||^2)``;
* firing probability (Eq. 12) ``P(h_j = 1 | x) = ||z_j||^2 / (1 + ||z_j||^2)``;
* the log-likelihood gradient (Eq. 18) and its CD-1 estimate (Algorithm 1), where
  dynamic routing with the cosine agreement supplies the couplings ``c`` that
  mix the chain: forward, reverse, forward again.

Shapes: ``W (I, J, Do, Di)`` maps an input capsule ``x_i (Di,)`` to a vote for
output capsule ``j`` of ``Do`` components; ``x (B, I, Di)``; couplings
``c (B, I, J)``. The book normalises couplings over ``J`` (``sum_j c_ij = 1``:
each input capsule distributes one unit over the output capsules), as
:func:`capslib.dynamic_routing` does; ``normalize="inputs"`` gives the other
reading of the paper (``sum_i c_ij = 1``) for comparison.

The decoder ``U (I, J, Di, Do)`` maps an output capsule back to the input
capsules (Sec. 4.1); it routes with couplings ``e (B, I, J)`` normalised over
``J`` as well, so each reconstructed input capsule is a weighted average of the
``J`` capsules' predictions, exactly like the reverse pass of Algorithm 1.

This module holds the mathematics; the model of the paper's Fig. 1 (:class:`~capslib.poe_models.PoECapsules`)
and the trainings of ``W`` and ``U`` are in :mod:`capslib.poe_models`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .checks import check_positive_int, check_tensor
from .ops import squash

_NORMALIZE = ("outputs", "inputs")
_EPS = 1e-12


# ----------------------------------------------------------------------------- checks

def _check_w(W: torch.Tensor, name: str = "W") -> None:
    check_tensor(name, W, dims=4, floating=True, shape_doc="(I, J, Do, Di)")


def _check_x(W: torch.Tensor, x: torch.Tensor, name: str = "x") -> None:
    check_tensor(name, x, dims=3, floating=True, shape_doc="(B, I, Di)")
    I, _, _, Di = W.shape
    if x.shape[1:] != (I, Di):
        raise ValueError(f"{name} must be (B, I, Di) = (B, {I}, {Di}) to match W (I, J, Do, Di) = "
                         f"{tuple(W.shape)}; got {tuple(x.shape)}")


def _check_c(W: torch.Tensor, x: torch.Tensor, c: torch.Tensor, name: str = "c") -> None:
    check_tensor(name, c, dims=3, floating=True, shape_doc="(B, I, J)")
    expected = (x.shape[0], W.shape[0], W.shape[1])
    if tuple(c.shape) != expected:
        raise ValueError(f"{name} must be (B, I, J) = {expected}; got {tuple(c.shape)}")


def _check_normalize(normalize: str) -> None:
    if normalize not in _NORMALIZE:
        raise ValueError(f"normalize must be one of {_NORMALIZE}; got {normalize!r}")


# ----------------------------------------------------------------------------- routing

def votes(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Predictions ``z_{j|i} = W_ij x_i`` (Hauser, Sec. 2.2; chapter 7): ``(B, I, J, Do)``."""
    _check_w(W)
    _check_x(W, x)
    return torch.einsum("ijoe,bie->bijo", W, x)


def cosine_routing(u_hat: torch.Tensor, iterations: int = 3, normalize: str = "outputs") -> torch.Tensor:
    """Routing by agreement with the cosine agreement (Hauser, Sec. 2.2; chapter 7).

    ``b = 0``; each iteration ``c = softmax(b)``, ``z_j = sum_i c_ij u_hat_{j|i}``
    (Eq. 3) and, except after the last, ``b_ij += cos(u_hat_{j|i}, z_j)``. The
    cosine ignores lengths, so no squash is needed inside the loop.

    Args:
        u_hat: votes ``(B, I, J, D)``.
        normalize: ``"outputs"``: softmax over ``J`` (``sum_j c_ij = 1``, the book's
            convention); ``"inputs"``: softmax over ``I`` (``sum_i c_ij = 1``).

    Returns:
        couplings ``c (B, I, J)``, computed without a graph (they are constants
        of the contrastive-divergence update).
    """
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
    check_positive_int("iterations", iterations)
    _check_normalize(normalize)
    dim = 2 if normalize == "outputs" else 1
    with torch.no_grad():
        u = u_hat.detach()
        inv_len = 1.0 / u.norm(dim=-1).clamp_min(_EPS)          # (B, I, J)
        b = u.new_zeros(u.shape[:3])
        for t in range(iterations):
            c = torch.softmax(b, dim=dim)
            if t < iterations - 1:
                z = torch.einsum("bij,bijd->bjd", c, u)            # Eq. 3
                z_unit = z / z.norm(dim=-1, keepdim=True).clamp_min(_EPS)
                b = b + torch.einsum("bijd,bjd->bij", u, z_unit) * inv_len   # cosine agreement
    return c


def route_forward(W: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``z_j = sum_i c_ij W_ij x_i`` (Hauser, Eq. 3; chapter 7): ``(B, J, Do)``."""
    _check_w(W)
    _check_x(W, x)
    _check_c(W, x, c)
    return torch.einsum("ijoe,bije->bjo", W, c.unsqueeze(-1) * x.unsqueeze(2))


def route_reverse(W: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Reverse pass of Algorithm 1: ``z~_i = sum_j c_ij W_ij^T y_j`` (Hauser; chapter 7): ``(B, I, Di)``.

    Args:
        W: ``(I, J, Do, Di)``; y: output capsules ``(B, J, Do)``; c: ``(B, I, J)``.
    """
    _check_w(W)
    check_tensor("y", y, dims=3, floating=True, shape_doc="(B, J, Do)")
    I, J, Do, _ = W.shape
    if y.shape[1:] != (J, Do):
        raise ValueError(f"y must be (B, J, Do) = (B, {J}, {Do}); got {tuple(y.shape)}")
    check_tensor("c", c, dims=3, floating=True, shape_doc="(B, I, J)")
    if tuple(c.shape) != (y.shape[0], I, J):
        raise ValueError(f"c must be (B, I, J) = {(y.shape[0], I, J)}; got {tuple(c.shape)}")
    return torch.einsum("ijoe,bijo->bie", W, c.unsqueeze(-1) * y.unsqueeze(1))


# ----------------------------------------------------------------------------- energy

def firing_probability(z: torch.Tensor) -> torch.Tensor:
    """``P(h_j = 1 | x) = ||z_j||^2 / (1 + ||z_j||^2)`` (Hauser, Eq. 12; chapter 7): ``(B, J, D)`` -> ``(B, J)``.

    Equal to ``sigmoid(log ||z_j||^2)`` and to the length of ``squash(z_j)`` (Eq. 13).
    """
    check_tensor("z", z, min_dim=1, floating=True)
    n2 = (z * z).sum(dim=-1)
    return n2 / (1.0 + n2)


def energy(W: torch.Tensor, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``E(x, h) = -sum_j h_j log ||z_j||^2`` (Hauser, Eq. 7; chapter 7): ``(B,)``.

    Args:
        h: ``(B, J)`` firing states in ``{0, 1}`` (or probabilities).
    """
    z = route_forward(W, x, c)
    check_tensor("h", h, dims=2, floating=True, shape_doc="(B, J)")
    if tuple(h.shape) != tuple(z.shape[:2]):
        raise ValueError(f"h must be (B, J) = {tuple(z.shape[:2])}; got {tuple(h.shape)}")
    return -(h * torch.log((z * z).sum(dim=-1))).sum(dim=1)


def free_energy(W: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Free energy ``F(x) = -sum_j log(1 + ||z_j||^2)`` (Hauser, Eq. 10 as ``P(x) = exp(-F(x)) / Z``; chapter 7).

    Args:
        W: ``(I, J, Do, Di)``; x: ``(B, I, Di)``; c: ``(B, I, J)``.

    Returns:
        ``(B,)``.
    """
    z = route_forward(W, x, c)
    return -torch.log1p((z * z).sum(dim=-1)).sum(dim=1)


def data_term(W: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Batch mean of ``2 c_ij z_j x_i^T / (1 + ||z_j||^2)`` (Hauser, Eq. 18, first term; chapter 7).

    Equals ``-d/dW mean_b F(x_b)`` with the couplings ``c`` held constant.

    Args:
        W: ``(I, J, Do, Di)``; x: ``(B, I, Di)``; c: ``(B, I, J)``.

    Returns:
        ``(I, J, Do, Di)``, the shape of ``W``.
    """
    return _data_term(route_forward(W, x, c), x, c)


def _data_term(z: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    g = z / (1.0 + (z * z).sum(dim=-1, keepdim=True))             # z_j / (1 + ||z_j||^2)
    return torch.einsum("bijo,bie->ijoe", c.unsqueeze(-1) * g.unsqueeze(1), x) * (2.0 / x.shape[0])


class CD1(NamedTuple):
    delta: torch.Tensor     # (I, J, Do, Di) Delta W of Algorithm 1
    c: torch.Tensor         # (B, I, J) couplings of the data
    y: torch.Tensor         # (B, J, Do) squash(z_j), the output capsules of the data
    x_tilde: torch.Tensor   # (B, I, Di) reconstructed input capsules
    y_tilde: torch.Tensor   # (B, J, Do) squash(z~_j)


def cd1(W: torch.Tensor, x: torch.Tensor, iterations: int = 3, normalize: str = "outputs") -> CD1:
    """One step of Algorithm 1 (Hauser; chapter 7) with every intermediate.

    ``c = RoutingByAgreement(x, W)``; ``z = sum_i c W x``; ``y = squash(z)``;
    ``z~_i = sum_j c W^T y``; ``x~ = squash(z~_i)``; ``z~_j = sum_i c W x~``;
    ``Delta W = data_term(W, x, c) - data_term(W, x~, c)`` (Eq. 18 with one
    step of mixing by dynamic routing).
    """
    _check_w(W)
    _check_x(W, x)
    with torch.no_grad():
        u = votes(W, x)
        c = cosine_routing(u, iterations, normalize)                # couplings from the data
        z = torch.einsum("bij,bijo->bjo", c, u)                     # route forward (Eq. 3)
        y = squash(z)
        x_tilde = squash(route_reverse(W, y, c))                    # reconstruct input capsules
        z_tilde = route_forward(W, x_tilde, c)                      # reconstruct output capsules
        delta = _data_term(z, x, c) - _data_term(z_tilde, x_tilde, c)   # Eq. 18, CD-1
    return CD1(delta, c, y, x_tilde, squash(z_tilde))


def cd1_gradient(W: torch.Tensor, x: torch.Tensor, iterations: int = 3, normalize: str = "outputs") -> torch.Tensor:
    """``Delta W`` of Algorithm 1 (Hauser, Eq. 18 estimated by CD-1; chapter 7).

    Args:
        W: ``(I, J, Do, Di)``; x: input capsules ``(B, I, Di)`` (squashed, lengths < 1).
        iterations: routing iterations for the couplings.
        normalize: ``"outputs"`` (``sum_j c_ij = 1``, default) or ``"inputs"``.

    Returns:
        the ascent direction of the log-likelihood, shape of ``W``.
    """
    return cd1(W, x, iterations, normalize).delta


# ----------------------------------------------------------------------------- decoder U

def decoder_votes(U: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``U_ij y_j`` for ``U (I, J, Di, Do)`` and ``y (B, J, Do)``: ``(B, I, J, Di)`` (Hauser, Sec. 4.1; chapter 7)."""
    check_tensor("U", U, dims=4, floating=True, shape_doc="(I, J, Di, Do)")
    check_tensor("y", y, dims=3, floating=True, shape_doc="(B, J, Do)")
    if y.shape[1:] != (U.shape[1], U.shape[3]):
        raise ValueError(f"y must be (B, J, Do) = (B, {U.shape[1]}, {U.shape[3]}) to match U (I, J, Di, Do) = "
                         f"{tuple(U.shape)}; got {tuple(y.shape)}")
    return torch.einsum("ijeo,bjo->bije", U, y)


def _decoder_couplings(u: torch.Tensor, iterations: int) -> torch.Tensor:
    with torch.no_grad():
        u = u.detach()
        inv_len = 1.0 / u.norm(dim=-1).clamp_min(_EPS)           # (B, I, J)
        b = u.new_zeros(u.shape[:3])
        for t in range(iterations):
            e = torch.softmax(b, dim=2)
            if t < iterations - 1:
                z = torch.einsum("bij,bije->bie", e, u)
                z_unit = z / z.norm(dim=-1, keepdim=True).clamp_min(_EPS)
                b = b + torch.einsum("bije,bie->bij", u, z_unit) * inv_len
    return e


def decoder_routing(U: torch.Tensor, y: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    """Couplings ``e (B, I, J)`` of the decoder (Hauser, Sec. 4.1; chapter 7).

    Each input capsule ``i`` is reconstructed as ``sum_j e_ij U_ij y_j`` with
    ``sum_j e_ij = 1``; ``e`` starts uniform and moves towards the ``j`` whose
    prediction agrees (cosine) with the reconstruction.
    """
    check_positive_int("iterations", iterations)
    return _decoder_couplings(decoder_votes(U, y), iterations)


def decode_capsules(U: torch.Tensor, y: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    """Route output capsules ``y (B, J, Do)`` down with ``U``: ``z_i = sum_j e_ij U_ij y_j``, ``(B, I, Di)``
    (Hauser, Sec. 4.1; chapter 7)."""
    check_positive_int("iterations", iterations)
    u = decoder_votes(U, y)
    return torch.einsum("bij,bije->bie", _decoder_couplings(u, iterations), u)


def decoder_gradient(U: torch.Tensor, y: torch.Tensor, target: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    """``Delta U`` of Hauser, Sec. 4.1 (chapter 7), the Algorithm-1 rule with the roles swapped.

    Data: the pair ``(t_i, y_j)`` given by the data and the trained ``W``.
    Model: ``z~_i = sum_j e_ij U_ij y_j`` and ``y~_j = squash(sum_i e_ij U_ij^T z~_i)``.
    ``Delta U_ij = mean_b 2 e_ij (t_i y_j^T / (1 + ||t_i||^2) - z~_i y~_j^T / (1 + ||z~_i||^2))``.

    Args:
        U: ``(I, J, Di, Do)``; y: ``(B, J, Do)``; target: ``(B, I, Di)``.

    Returns:
        ``(I, J, Di, Do)``.
    """
    check_positive_int("iterations", iterations)
    u = decoder_votes(U, y)
    check_tensor("target", target, dims=3, floating=True, shape_doc="(B, I, Di)")
    if tuple(target.shape) != (y.shape[0], U.shape[0], U.shape[2]):
        raise ValueError(f"target must be (B, I, Di) = {(y.shape[0], U.shape[0], U.shape[2])}; "
                         f"got {tuple(target.shape)}")
    with torch.no_grad():
        e = _decoder_couplings(u, iterations)
        z_t = torch.einsum("bij,bije->bie", e, u)                                  # model: route down
        y_t = squash(torch.einsum("ijeo,bije->bjo", U, e.unsqueeze(-1) * z_t.unsqueeze(2)))  # and up again
        g_data = target / (1.0 + (target * target).sum(dim=-1, keepdim=True))
        g_model = z_t / (1.0 + (z_t * z_t).sum(dim=-1, keepdim=True))
        pos = torch.einsum("bije,bjo->ijeo", e.unsqueeze(-1) * g_data.unsqueeze(2), y)
        neg = torch.einsum("bije,bjo->ijeo", e.unsqueeze(-1) * g_model.unsqueeze(2), y_t)
    return (pos - neg) * (2.0 / y.shape[0])


# ----------------------------------------------------------------------------- the sparsity term

def _routing_differentiable(u_hat: torch.Tensor, iterations: int, normalize: str) -> torch.Tensor:
    """:func:`cosine_routing` with the graph kept, so that ``c`` can be differentiated w.r.t. ``W`` and ``x``."""
    dim = 2 if normalize == "outputs" else 1
    inv_len = 1.0 / u_hat.norm(dim=-1).clamp_min(_EPS)
    b = u_hat.new_zeros(u_hat.shape[:3])
    for t in range(iterations):
        c = torch.softmax(b, dim=dim)
        if t < iterations - 1:
            z = torch.einsum("bij,bijd->bjd", c, u_hat)
            z_unit = z / z.norm(dim=-1, keepdim=True).clamp_min(_EPS)
            b = b + torch.einsum("bijd,bjd->bij", u_hat, z_unit) * inv_len
    return c


def sparsity_term(W: torch.Tensor, x: torch.Tensor, c: torch.Tensor, target: float) -> torch.Tensor:
    """Ascent direction of ``-1/2 sum_j (q_j - target)^2`` with ``q_j = mean_b P(h_j = 1 | x_b)`` (chapter 7).

    The RBM sparsity penalty of Lee et al. (2008) on the firing probability of Eq. 12, couplings held
    constant: ``(target - q_j) mean_b 2 c_ij z_j x_i^T / (1 + ||z_j||^2)^2``. Added to the CD-1 update it
    makes a capsule that fires for every image pay, which is what an expert that reads the mean pattern does.

    Args:
        W: ``(I, J, Do, Di)``; x: ``(B, I, Di)``; c: ``(B, I, J)``; target: the wanted mean firing
            probability in ``(0, 1)``.

    Returns:
        ``(I, J, Do, Di)``.
    """
    if not 0.0 < target < 1.0:
        raise ValueError(f"target must lie in (0, 1); got {target}")
    z = route_forward(W, x, c)
    n2 = (z * z).sum(-1)
    q = (n2 / (1.0 + n2)).mean(0)                                             # (J,)
    g = z / (1.0 + n2).pow(2).unsqueeze(-1)
    dq = torch.einsum("bij,bjo,bie->ijoe", c, g, x) * (2.0 / x.shape[0])      # d q_j / d W_ij
    return (target - q).view(1, -1, 1, 1) * dq
