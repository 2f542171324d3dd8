"""Routing-by-agreement (Sabour et al. 2017, Procedure 1; chapter 2).

Couplings ``c`` are ``(B, I, J)``: each input capsule ``i`` distributes one unit
over its parents ``j`` (softmax over ``J``).
"""
from __future__ import annotations

import torch

from .checks import check_positive_int, check_tensor
from .ops import Reads, bmm, squash


def dynamic_routing(u_hat: torch.Tensor, iterations: int = 3, detach: bool = False):
    """Dynamic routing of Sabour et al. 2017, Procedure 1 (chapter 2; chapter 4 for ``detach``).

    Starting from logits ``b = 0``, each iteration computes
    ``c_i = softmax_j(b_i)`` (Eq. 3), ``s_j = sum_i c_ij u_hat_{j|i}`` (Eq. 2),
    ``v_j = squash(s_j)`` (Eq. 1), and, except after the last, the agreement
    update ``b_ij += u_hat_{j|i} . v_j``.

    Args:
        u_hat: votes ``(B, I, J, D)``.
        iterations: number of routing iterations ``r >= 1``.
        detach: if True the couplings are constants for back-propagation
            (Gu & Tresp 2020): the logits are computed without a graph and the
            gradient reaches ``u_hat`` only through ``s_j = sum_i c_ij u_hat_{j|i}``.

    Returns:
        ``(v, c)``: output capsules ``(B, J, D)`` and the couplings ``(B, I, J)``
        that produced them (those of the last iteration).

    The pass runs parent-major (votes ``(B*J, I, D)``, logits ``(B, J, I)``), each read of the votes
    through :class:`capslib.ops.Reads`; full and detached passes compute the same forward values.
    """
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
    check_positive_int("iterations", iterations)
    u = by_parent(u_hat)
    reads = Reads(u.detach() if detach else u)
    b = _zero_logits(u_hat)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
        for _ in range(iterations - 1):
            b = b + agreement(reads, squash(weighted_sum(softmax_parents(b), reads)))
        c = softmax_parents(b)
    v = squash(weighted_sum(c, u if detach else reads))
    return v, c.transpose(1, 2).contiguous()


def by_parent(u_hat: torch.Tensor) -> torch.Tensor:
    """Votes ``(B, I, J, D)`` parent-major, ``(B*J, I, D)``: one copy that every contraction reads."""
    B, I, J, D = u_hat.shape
    return u_hat.transpose(1, 2).reshape(B * J, I, D)


def _zero_logits(u_hat: torch.Tensor) -> torch.Tensor:   # b = 0, parent-major (B, J, I)
    return u_hat.new_zeros(u_hat.shape[0], u_hat.shape[2], u_hat.shape[1])


def softmax_parents(b: torch.Tensor) -> torch.Tensor:
    """Eq. 3 for parent-major logits ``b (B, J, I)``: each input capsule's couplings sum to one over its
    parents (dimension 1). On 2 cores, chapter 2's ``ci`` couplings: 0.06 ms, against 1.15 ms over the last
    dimension of ``(B, I, J)`` (10 per row)."""
    return torch.softmax(b, dim=1)


def weighted_sum(c: torch.Tensor, u) -> torch.Tensor:
    """``s_j = sum_i c_ij u_hat_{j|i}`` (Eq. 2), ``(B, J, D)``, for couplings ``c (B, J, I)`` and the votes
    of :func:`by_parent` (a tensor or its :class:`capslib.ops.Reads`)."""
    B, J, I = c.shape
    w = c.reshape(B * J, 1, I)
    s = u.weigh(w) if isinstance(u, Reads) else bmm(w, u)
    return s.view(B, J, -1)


def agreement(u, v: torch.Tensor) -> torch.Tensor:
    """``u_hat_{j|i} . v_j``, ``(B, J, I)``, for the votes of :func:`by_parent` (a tensor or its
    :class:`capslib.ops.Reads`) and outputs ``v (B, J, D)``."""
    B, J, D = v.shape
    z = v.reshape(B * J, D, 1)
    a = u.project(z) if isinstance(u, Reads) else bmm(u, z)
    return a.view(B, J, -1)


def routing_trace(u_hat: torch.Tensor, iterations: int = 3):
    """Couplings and outputs after every routing iteration (for figures; chapter 2).

    Returns lists ``cs`` (each ``(B, I, J)``) and ``vs`` (each ``(B, J, D)``) of
    length ``iterations``; ``cs[-1], vs[-1]`` equal :func:`dynamic_routing`'s result.
    Runs without a graph.
    """
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
    check_positive_int("iterations", iterations)
    cs, vs = [], []
    with torch.no_grad():
        u = by_parent(u_hat)      # no graph: the plain votes (a Reads would only call the same products)
        b = _zero_logits(u_hat)
        for _ in range(iterations):
            c = softmax_parents(b)
            v = squash(weighted_sum(c, u))
            b = b + agreement(u, v)
            cs.append(c.transpose(1, 2).contiguous())
            vs.append(v)
    return cs, vs
