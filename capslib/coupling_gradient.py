"""The coupling-gradient argument of Gu & Tresp (2020, supplementary Appx. A and C; chapter 4).

Dynamic routing makes the couplings ``c`` functions of the votes ``u_hat``. The
gradient of a loss with respect to a vote therefore has two parts (their Eq. 1):
a *direct* term, through ``s_j = sum_i c_ij u_hat_{j|i}`` with ``c`` held fixed,
and a term *through the couplings*. Gu & Tresp argue the second term is small and
drop it ("detached" routing). This module computes both terms by hand and by autograd,
compares them vote by vote, summarises how polarized the couplings are (their Eq. 4-5),
and runs routing with each iteration's tensors named (:func:`routing_trace`).

Shapes use the book's letters: ``B`` batch, ``I`` input capsules, ``J`` output
capsules, ``D`` output capsule dimension.
"""
from __future__ import annotations

import math

import torch

from .checks import check_positive_int, check_tensor
from .ops import squash


# ----------------------------------------------------------------------------- routing with a logit scale

def _check_votes(u_hat):
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")


def _check_grad_v(u_hat, grad_v):
    check_tensor("grad_v", grad_v, dims=3, floating=True, shape_doc="(B, J, D)")
    B, _, J, D = u_hat.shape
    if tuple(grad_v.shape) != (B, J, D):
        raise ValueError(f"grad_v must be (B, J, D) = ({B}, {J}, {D}) to match u_hat; got {tuple(grad_v.shape)}")


def _check_scale(value, name: str = "logit_scale"):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0; got {value!r}")


def scaled_routing(u_hat: torch.Tensor, iterations: int = 3, logit_scale: float = 1.0, detach: bool = False):
    """Dynamic routing with couplings ``c_i = softmax_j(lambda * b_i)`` (chapter 4).

    With ``logit_scale`` ``lambda = 1`` this is :func:`capslib.dynamic_routing`
    (Sabour et al. 2017, Procedure 1). A larger ``lambda`` sharpens the softmax, so
    the couplings polarize towards 0 and 1: the knob chapter 4 turns to test
    Gu & Tresp's Eq. 4-5. ``detach=True`` treats the couplings as constants.

    Args:
        u_hat: votes ``(B, I, J, D)``.

    Returns:
        ``(v (B, J, D), c (B, I, J))``.
    """
    _check_votes(u_hat)
    check_positive_int("iterations", iterations)
    _check_scale(logit_scale)
    votes = u_hat.detach() if detach else u_hat
    b = u_hat.new_zeros(u_hat.shape[:3])
    with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
        for _ in range(iterations - 1):
            c = torch.softmax(logit_scale * b, dim=2)
            v = squash(torch.einsum("bij,bijd->bjd", c, votes))
            b = b + torch.einsum("bijd,bjd->bij", votes, v)
        c = torch.softmax(logit_scale * b, dim=2)
    v = squash(torch.einsum("bij,bijd->bjd", c, u_hat))
    return v, c


# ----------------------------------------------------------------------------- Eq. 1 by hand

def squash_vjp(s: torch.Tensor, grad_v: torch.Tensor) -> torch.Tensor:
    """``(dv/ds)^T grad_v`` for ``v = squash(s)``, written out (Sabour et al. Eq. 1; chapter 4).

    With ``n = ||s||`` the Jacobian is symmetric:
    ``dv/ds = n/(1+n^2) I + (1-n^2)/(n (1+n^2)^2) s s^T``.

    Args:
        s: ``(..., D)`` pre-squash vectors (none of them zero).
        grad_v: ``(..., D)``, the same shape.
    """
    check_tensor("s", s, min_dim=1, floating=True)
    check_tensor("grad_v", grad_v, min_dim=1, floating=True)
    if s.shape != grad_v.shape:
        raise ValueError(f"grad_v must have the shape of s {tuple(s.shape)}; got {tuple(grad_v.shape)}")
    n2 = (s * s).sum(-1, keepdim=True)
    n = n2.sqrt()
    a = n / (1 + n2)
    k = (1 - n2) / (n.clamp_min(1e-30) * (1 + n2) ** 2)  # at s = 0: k s s^T = 0, like squash's derivative
    return a * grad_v + k * s * (s * grad_v).sum(-1, keepdim=True)


def _softmax_vjp(c: torch.Tensor, grad_c: torch.Tensor) -> torch.Tensor:
    # dc_ij/db_ik = c_ij (delta_jk - c_ik)  ->  grad_b_ik = c_ik (grad_c_ik - sum_j c_ij grad_c_ij)
    return c * (grad_c - (c * grad_c).sum(-1, keepdim=True))


def gradient_by_iteration(u_hat: torch.Tensor, grad_v: torch.Tensor, iterations: int = 3,
                          logit_scale: float = 1.0) -> torch.Tensor:
    """``dL/du_hat`` split by the routing iteration through which it reaches the votes, without
    autograd (chapter 4): the adjoint recursion, line 5, kept apart per iteration.

    The votes enter iteration ``t`` twice: in ``s^(t) = sum_i c^(t) u_hat`` and, for ``t < K``, in the
    logit update ``b^(t+1) = b^(t) + u_hat . v^(t)``. Entry ``t`` (0-based) of the result is what
    flows back along those two uses. The last entry is the direct term of Gu & Tresp's Eq. 1 (the
    detached gradient); the others sum to its second term, through the couplings.

    Args and checks as :func:`gradient_terms`. Returns ``(K, B, I, J, D)``; the sum over the first
    axis is the full gradient.
    """
    _check_votes(u_hat)
    _check_grad_v(u_hat, grad_v)
    check_positive_int("iterations", iterations)
    _check_scale(logit_scale)
    u = u_hat.detach()
    gv = grad_v.detach()
    lam = float(logit_scale)
    # forward pass, keeping every intermediate
    b = u.new_zeros(u.shape[:3])
    cs, ss, vs = [], [], []
    for t in range(iterations):
        c = torch.softmax(lam * b, dim=2)                     # Eq. 2 (softmax of the logits)
        s = torch.einsum("bij,bijd->bjd", c, u)               # s_j = sum_i c_ij u_hat_{j|i}
        v = squash(s)
        cs.append(c), ss.append(s), vs.append(v)
        if t < iterations - 1:
            b = b + torch.einsum("bijd,bjd->bij", u, v)        # B_ij += u_hat_{j|i} . v_j
    # backward pass
    K = iterations - 1
    pieces = u.new_zeros((iterations, *u.shape))
    gs = squash_vjp(ss[K], gv)                                # (dv/ds)^T dL/dv, (B, J, D)
    pieces[K] = cs[K].unsqueeze(-1) * gs.unsqueeze(1)         # Eq. 1, first term
    gc = torch.einsum("bjd,bijd->bij", gs, u)                 # dL/dc_ij = gs_j . u_hat_{j|i}
    gb = lam * _softmax_vjp(cs[K], gc)                        # Eq. 3: through the softmax
    for t in range(K - 1, -1, -1):
        # b^(t+1) = b^(t) + u_hat . v^(t): the logits' gradient reaches u_hat and v^(t)
        pieces[t] += gb.unsqueeze(-1) * vs[t].unsqueeze(1)
        gvt = torch.einsum("bij,bijd->bjd", gb, u)
        gst = squash_vjp(ss[t], gvt)
        pieces[t] += cs[t].unsqueeze(-1) * gst.unsqueeze(1)   # s^(t) = sum_i c^(t) u_hat
        gct = torch.einsum("bjd,bijd->bij", gst, u)
        gb = gb + lam * _softmax_vjp(cs[t], gct)              # b^(t) feeds the next logits and c^(t)
    return pieces


def gradient_terms(u_hat: torch.Tensor, grad_v: torch.Tensor, iterations: int = 3, logit_scale: float = 1.0):
    """The two terms of ``dL/du_hat`` (Gu & Tresp, supplement Eq. 1), without autograd (chapter 4).

    ``grad_v = dL/dv`` at the routing output. The first term is the gradient with the
    final couplings held constant, ``c_im^(K) (dv_m/ds_m)^T dL/dv_m``; the second is
    everything that reaches ``u_hat`` because the couplings depend on it: the
    softmax derivative (their Eq. 3) and the agreement updates of every earlier
    iteration, unrolled by hand back to ``b = 0`` (:func:`gradient_by_iteration`, summed).

    Args:
        u_hat: votes ``(B, I, J, D)``.
        grad_v: ``(B, J, D)``.
        iterations: ``K >= 1``; ``K = 1`` has uniform couplings and no second term.
        logit_scale: ``lambda`` of :func:`scaled_routing`.

    Returns:
        ``(direct, through_couplings)``, each ``(B, I, J, D)``; their sum is the full
        gradient and ``direct`` is the gradient of detached routing.
    """
    pieces = gradient_by_iteration(u_hat, grad_v, iterations, logit_scale)
    return pieces[-1], pieces[:-1].sum(0)


def autograd_terms(u_hat: torch.Tensor, grad_v: torch.Tensor, iterations: int = 3, logit_scale: float = 1.0):
    """``(full, detached)`` gradients of ``sum(v * grad_v)`` with respect to ``u_hat`` by autograd.

    The reference for :func:`gradient_terms` (chapter 4): ``full`` should equal
    ``direct + through_couplings`` and ``detached`` should equal ``direct``.
    """
    _check_votes(u_hat)
    _check_grad_v(u_hat, grad_v)
    out = []
    for detach in (False, True):
        u = u_hat.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            v, _ = scaled_routing(u, iterations, logit_scale, detach=detach)
            (g,) = torch.autograd.grad((v * grad_v.detach()).sum(), u)
        out.append(g)
    return tuple(out)


def second_term_ratio(u_hat: torch.Tensor, grad_v: torch.Tensor, iterations: int = 3,
                      logit_scale: float = 1.0) -> float:
    """``||second term|| / ||full gradient||`` of Eq. 1 over the whole vote tensor (chapter 4)."""
    direct, through = gradient_terms(u_hat, grad_v, iterations, logit_scale)
    return float(through.norm() / (direct + through).norm().clamp_min(1e-30))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine along the last axis, each vector divided by its largest entry before any norm (a direct term of a vote
    with c_im << 1e-3 is too small to square), so that tiny vectors keep their exact cosine; 0 for a zero vector."""
    tiny = torch.finfo(a.dtype).tiny
    a, b = (torch.nn.functional.normalize(v / v.abs().amax(-1, keepdim=True).clamp_min(tiny), dim=-1) for v in (a, b))
    return (a * b).sum(-1)


def per_vote_comparison(u_hat: torch.Tensor, grad_v: torch.Tensor, iterations: int = 3,
                        logit_scale: float = 1.0) -> dict:
    """Per vote ``(b, i, m)``: the coupling ``c_im``, ``||second|| / ||full||`` and the cosine between the full and the
    detached gradient (Gu & Tresp Eq. 4-5; chapter 4), as flat tensors ``c``, ``ratio``, ``cosine`` of ``B * I * J``."""
    direct, through = gradient_terms(u_hat, grad_v, iterations, logit_scale)
    _, c = scaled_routing(u_hat.detach(), iterations, logit_scale)
    full, tiny = direct + through, torch.finfo(direct.dtype).tiny
    scale = torch.maximum(full.abs().amax(-1), through.abs().amax(-1)).clamp_min(tiny)[..., None]   # as in _cosine
    ratio = (through / scale).norm(dim=-1) / (full / scale).norm(dim=-1).clamp_min(tiny)
    return {"c": c.flatten(), "ratio": ratio.flatten(), "cosine": _cosine(full, direct).flatten()}


# ----------------------------------------------------------------------------- polarization

def polarization(c: torch.Tensor, high: float = 0.9, low: float = 0.1) -> dict:
    """How polarized couplings ``c (B, I, J)`` are (Gu & Tresp, discussion of Eq. 4-5; chapter 4).

    Returns ``entropy`` (mean over ``b, i`` of ``-sum_j c_ij ln c_ij``, nats),
    ``max_entropy`` (``ln J``, the uniform row), ``frac_high`` (share of ``c_ij > high``),
    ``frac_low`` (share below ``low``) and ``frac_polarized`` (their sum). Note that with
    ``J = 10`` the uniform coupling is exactly 0.1.
    """
    check_tensor("c", c, dims=3, floating=True, shape_doc="(B, I, J)")
    if not 0 <= low < high <= 1:
        raise ValueError(f"need 0 <= low < high <= 1; got low={low}, high={high}")
    c = c.detach()
    ent = -(c * c.clamp_min(1e-30).log()).sum(-1).mean()
    fh = float((c > high).float().mean())
    fl = float((c < low).float().mean())
    return {"entropy": float(ent), "max_entropy": math.log(c.shape[-1]), "frac_high": fh, "frac_low": fl,
            "frac_polarized": fh + fl}


# ----------------------------------------------------------------------------- per-vote gains


def vote_gains(u_hat: torch.Tensor, grad_v: torch.Tensor, iterations: int = 3, logit_scale: float = 1.0) -> dict:
    """How the full gradient of each vote relates to its detached one (Gu & Tresp Eq. 5, full = C x detached;
    chapter 4): per vote ``(b, i, m)`` with a non-zero detached (direct) term, ``gain = (full . direct) / ||direct||^2``
    (the ``C`` it would need), ``norm_ratio = ||full|| / ||direct||``, the ``cosine`` and ``c`` (its coupling), with
    ``has_direct`` (a bool mask over all ``B * I * J`` votes; the others hold only its True votes, in flat order)."""
    direct, through = gradient_terms(u_hat, grad_v, iterations, logit_scale)
    _, c = scaled_routing(u_hat.detach(), iterations, logit_scale)
    full = (direct + through).flatten(0, 2)
    d = direct.flatten(0, 2)
    has = d.abs().amax(-1) > 0    # both divided by d's largest entry: no tiny term is squared
    full, d = (v[has] / d[has].abs().amax(-1, keepdim=True) for v in (full, d))
    dn = d.norm(dim=-1)
    return {"has_direct": has, "c": c.flatten()[has], "gain": (full * d).sum(-1) / dn ** 2,
            "norm_ratio": full.norm(dim=-1) / dn, "cosine": _cosine(full, d)}


# ----------------------------------------------------------------------------- routing, every tensor named (Appx. C)

def routing_trace(u_hat: torch.Tensor, iterations: int = 3, detach: bool = False):
    """Dynamic routing that keeps each iteration's tensors under their names (chapter 4).

    The same computation as :func:`scaled_routing` at ``logit_scale = 1`` (and so as
    :func:`capslib.dynamic_routing`): ``B(t)``, ``c(t)``, ``s(t)``, ``v(t)`` for ``t = 1..K``,
    with ``B(1) = 0``. Chapter 4 reads from autograd which of them feed which
    (``capslib.book.ch04.semantic_graph``).

    Returns:
        ``(v (B, J, D), {name: tensor})``.
    """
    _check_votes(u_hat)
    check_positive_int("iterations", iterations)
    votes = u_hat.detach() if detach else u_hat
    named = {}
    b = u_hat.new_zeros(u_hat.shape[:3])
    for t in range(1, iterations + 1):
        last = t == iterations
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):  # detached: c is a constant
            c = torch.softmax(b, dim=2)
        named[f"B({t})"], named[f"c({t})"] = b, c
        with torch.set_grad_enabled(torch.is_grad_enabled() and not (detach and not last)):
            s = torch.einsum("bij,bijd->bjd", c, u_hat if last else votes)
            v = squash(s)
        named[f"s({t})"], named[f"v({t})"] = s, v
        if not last:
            with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
                b = b + torch.einsum("bijd,bjd->bij", votes, v)
    return v, named

