"""Matrix capsules with EM routing (Hinton, Sabour & Frosst 2018; chapter 5).

A matrix capsule has a 4x4 pose matrix ``M`` and an activation ``a`` in ``(0, 1)``.
Child ``i`` votes for parent ``j`` with ``V_ij = M_i W_ij``; EM routing fits a
mixture of axis-aligned Gaussians (one per parent) to the votes, where each vote
is weighted by its child's activation (Procedure 1 of the paper).

Shapes use the book's letters: ``B`` batch, ``I`` input (child) capsules, ``J``
output (parent) capsules, ``H`` pose entries (16 for a 4x4 pose).

Numerical choices (all stated in chapter 5):

* the E-step works in log space (``logsumexp`` over parents, ``logsigmoid`` for
  ``log a'``), so tiny densities or activations never underflow to ``0/0``;
* every variance gets a floor ``var_floor`` added and every sum of assignments
  ``sum_i r'_ij`` is clamped to at least ``eps``, so identical votes, all-zero
  activations and huge votes stay finite (with all activations 0 the parent's
  mean is the plain mean of its votes);
* the inverse temperature rises on a fixed schedule,
  ``lambda_t = final_lambda * (t + 1) / iterations`` for ``t = 0 .. iterations - 1``;
* a deliberate change to Procedure 1 (default ``normalize="mean"``): the amount of data
  ``sum_i r'_ij`` in the cost is divided by the number of children ``I``, so the cost does
  not grow with ``I`` and ``lambda`` of order 1 suits every layer and input size (after
  Gritzman 2019, "Avoiding implementation pitfalls of matrix capsule networks with EM
  routing", pitfall 2); ``normalize="none"`` runs the printed rule.

This module holds the routing and the loss; the matrix-capsule layers that route with it and the
network of the paper's Fig. 1 are in :mod:`capslib.em_layers`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checks import check_positive_int, check_tensor
from .ops import Reads

FINAL_LAMBDA = 1.0    # lambda of the last routing iteration, for normalised costs (the paper gives no value)
LITERAL_FINAL_LAMBDA = 0.03   # a workable lambda for the literal (unnormalised) cost at the ci network's scale
NORMALIZE = "mean"    # how the M-step's cost is scaled before the sigmoid: "mean", "none" or "std"
NORMALIZATIONS = ("mean", "none", "std")
STD_EPS = 1e-4        # inside the square root of the standard deviation of the costs
VAR_FLOOR = 1e-4      # added to every sigma_h^2
EPS = 1e-6            # floor of every sum of assignments sum_i r'_ij



# ----------------------------------------------------------------------------- routing

SCHEDULES = ("ramp", "constant", "authors")
# the schedule Hinton et al. gave in their OpenReview reply, as quoted in the source of
# IBM/matrix-capsules-with-em-routing (em_routing.py): lambda_t = final_lambda * (1 - 0.95 ** (t + 1)), with
# final_lambda = 0.01 for their unnormalised cost (``normalize="none"``)
AUTHORS_FINAL_LAMBDA = 0.01


def _check_schedule(schedule):
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")


def inverse_temperatures(iterations: int, final_lambda: float = FINAL_LAMBDA, schedule: str = "ramp") -> list[float]:
    """The fixed schedule of the inverse temperature lambda over routing iterations (chapter 5).

    Procedure 1 of Hinton et al. 2018 says only that lambda "increases at each
    iteration with a fixed schedule"; this book's default (``schedule="ramp"``) raises it linearly,
    ``lambda_t = final_lambda * (t + 1) / iterations`` for ``t = 0 .. iterations - 1``,
    so the last M-step always uses ``final_lambda`` whatever the number of iterations. The ramp
    makes every ``lambda_t`` depend on the number of iterations (with one iteration the only
    M-step runs at ``final_lambda``, with three the first runs at a third of it), so a comparison
    of iteration counts also compares schedules. ``schedule="constant"`` uses ``final_lambda`` in
    every iteration: then iteration ``t`` is the same computation whatever the number of
    iterations, and only their number differs (chapter 5's iteration study). ``schedule="authors"``
    is the schedule the paper's authors gave (see :data:`AUTHORS_FINAL_LAMBDA`): ``lambda_t =
    final_lambda * (1 - 0.95 ** (t + 1))``, which like "constant" does not depend on the number of
    iterations, and rises slowly towards ``final_lambda`` without reaching it.
    """
    check_positive_int("iterations", iterations)
    if not final_lambda > 0:
        raise ValueError(f"final_lambda must be > 0; got {final_lambda}")
    _check_schedule(schedule)
    if schedule == "constant":
        return [float(final_lambda)] * iterations
    if schedule == "authors":
        return [final_lambda * (1.0 - 0.95 ** (t + 1)) for t in range(iterations)]
    return [final_lambda * (t + 1) / iterations for t in range(iterations)]


def _beta(name: str, beta, ref: torch.Tensor, J: int) -> torch.Tensor:
    """A beta (float, (J,) or (B, J)) as a tensor broadcastable to (B, J)."""
    if isinstance(beta, (int, float)) and not isinstance(beta, bool):
        return ref.new_tensor(float(beta))
    if not isinstance(beta, torch.Tensor):
        raise TypeError(f"{name} must be a float or a tensor of shape (), (J,) or (B, J); got {type(beta).__name__}")
    if beta.dim() > 2 or (beta.dim() >= 1 and beta.shape[-1] not in (1, J)):
        raise ValueError(f"{name} must have shape (), (J,) or (B, J) with J = {J}; got {tuple(beta.shape)}")
    return beta.to(ref.dtype)


class EMState(NamedTuple):
    mu: torch.Tensor       # (B, J, H) parent means after this iteration's M-step
    sigma2: torch.Tensor   # (B, J, H) their variances (floor included)
    a: torch.Tensor        # (B, J) parent activations a'
    R: torch.Tensor        # (B, I, J) assignments from this iteration's E-step


def _em(Vt, a, beta_u, beta_a, iterations, final_lambda, var_floor, eps, final_e_step, trace=None,
        detach=False, normalize="mean", schedule="ramp", renormalise=False):
    """EM routing on votes laid out ``Vt (B, J, I, H)``; returns ``mu (B, J, H)``, ``a' (B, J)``,
    ``R (B, J, I)``.

    The same mathematics as Procedure 1, arranged so that the large ``(B, J, I, H)``
    tensor is only read by matrix products inside the loop:

    * the votes are centred per parent, ``V~ = V - mean_i V`` (a shift of every vote of
      parent ``j`` by one vector leaves sigma^2, p and R unchanged and moves mu by
      the same vector), so the moment formulas below do not cancel large numbers;
    * with normalised weights ``w_ij = r'_ij / max(sum_i r'_ij, eps)`` and
      ``s = sum_i w_ij`` (1 unless ``sum_i r'_ij < eps``): ``mu = sum_i w V~``,
      ``sigma^2 = sum_i w V~^2 - (2 - s) mu^2`` (= ``sum_i w (V~ - mu)^2`` exactly);
    * ``sum_h (V~ - mu)^2 / (2 sigma^2) = V~^2 . q - 2 V~ . (mu q) + mu^2 . q`` with
      ``q = 1 / (2 sigma^2)``, three contractions over ``h``.
    """
    B, J, I, H = Vt.shape
    bu, ba = _beta("beta_u", beta_u, Vt, J), _beta("beta_a", beta_a, Vt, J)
    shift = Vt.mean(dim=2, keepdim=True)                       # (B, J, 1, H)
    V = Vt - shift
    V2 = V * V
    # one matrix product per step reads both halves; every read's gradient is gathered (ops.Reads)
    VV = Reads(torch.cat([V, V2], dim=-1).reshape(B * J, I, 2 * H))
    a = a.unsqueeze(1)                                         # (B, 1, I)
    R = Vt.new_full((B, J, I), 1.0 / J)                        # Procedure 1, line 1
    for t, lam in enumerate(inverse_temperatures(iterations, final_lambda, schedule)):
        # with detach, only the last M-step (and E-step) is recorded for back-propagation:
        # the assignments R it starts from are constants, as in Gu & Tresp's detached routing
        grad = not detach or t == iterations - 1
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            mu, sigma2, logit, R = _em_round(V, V2, a, R, bu, ba, lam, var_floor, eps,
                                             t < iterations - 1 or final_e_step, normalize, VV, renormalise)
        if trace is not None:
            trace.append(EMState(mu + shift.squeeze(2), sigma2, torch.sigmoid(logit), R.transpose(1, 2)))
    return mu + shift.squeeze(2), torch.sigmoid(logit), R


def _em_round(V, V2, a, R, bu, ba, lam, var_floor, eps, do_e_step, normalize="mean", VV=None, renormalise=False):
    """One M-step and (if ``do_e_step``) one E-step on centred votes ``V (B, J, I, H)``.

    ``renormalise``: the pitfall of :func:`em_routing` (``renormalise_over_parents``).

    ``VV`` is :class:`capslib.ops.Reads` of ``cat([V, V2], -1)`` laid out ``(B*J, I, 2H)`` when the caller
    has it: then each step reads the vote tensor with a single batched matrix product instead of two,
    and the votes' gradient from every read of the loop is formed once, by one matrix product.
    """
    H = V.shape[-1]
    # M-step
    rp = R * a                                             # r'_ij = R_ij a_i
    if renormalise:                                        # the pitfall: r' / sum_j r' = R, the activations cancel
        rp = rp / rp.sum(dim=1, keepdim=True).clamp_min(eps)
    rsum = rp.sum(dim=2)                                   # sum_i r'_ij          (B, J)
    denom = rsum.clamp_min(eps)                            # = sum_i r'_ij unless it is below eps
    w = rp / denom.unsqueeze(-1)
    s = (rsum / denom).unsqueeze(-1)                       # sum_i w_ij: 1, or < 1 when sum_i r'_ij < eps
    # batched (1 x I) @ (I x H) products; written with matmul rather than einsum, whose backward
    # pass took several times longer here (CPU, torch 2.13)
    wr = w.unsqueeze(-2)                                   # (B, J, 1, I)
    B, J, I = w.shape
    if VV is None:
        mu = torch.matmul(wr, V).squeeze(-2)               # mu_jh (centred)
        ex2 = torch.matmul(wr, V2).squeeze(-2)
    else:
        mu, ex2 = VV.weigh(wr.reshape(B * J, 1, I)).view(B, J, 2 * H).split(H, dim=-1)
    sigma2 = (ex2 - (2.0 - s) * mu * mu).clamp_min(0.0) + var_floor
    amount = rsum / V.shape[2] if normalize == "mean" else rsum   # Eq. ch5-costnorm: sum_i r'_ij / I
    cost = ((bu.unsqueeze(-1) + 0.5 * torch.log(sigma2)) * amount.unsqueeze(-1)).sum(dim=-1)   # sum_h cost_jh
    if normalize == "std":
        cost = standardize_cost(cost)
    logit = lam * (ba - cost)                              # a'_j = sigmoid(logit_j)
    # E-step, in log space
    if do_e_step:
        q = 0.5 / sigma2
        if VV is None:
            quad = (torch.matmul(V2, q.unsqueeze(-1)) - 2.0 * torch.matmul(V, (mu * q).unsqueeze(-1))).squeeze(-1)
        else:
            z = torch.cat([-2.0 * mu * q, q], dim=-1)
            quad = VV.project(z.reshape(B * J, 2 * H, 1)).view(B, J, I)
        quad = quad + (mu * mu * q).sum(dim=-1, keepdim=True)
        logp = -quad - 0.5 * torch.log(2.0 * math.pi * sigma2).sum(dim=-1, keepdim=True)
        R = torch.softmax(F.logsigmoid(logit).unsqueeze(-1) + logp, dim=1)
    return mu, sigma2, logit, R


def standardize_cost(cost: torch.Tensor, eps: float = STD_EPS) -> torch.Tensor:
    """``(cost - mean_j cost) / sqrt(var_j cost + eps)`` over the parents ``J`` of ``cost (B, J)`` (chapter 5,
    Eq. ch5-actnorm).

    The book's deliberate change to Procedure 1: ``sum_h cost_jh`` grows with the number of
    children ``sum_i r'_ij`` and with ``H``, so the literal ``sigmoid(lambda (beta_a - cost))`` needs a
    tiny ``lambda`` that changes with the layer; standardised over the competing parents, the
    cost has mean 0 and spread 1 in every layer and ``lambda`` of order 1 works. ``eps`` inside
    the square root keeps the gradient finite when all parents cost the same (e.g. ``J = 1``).
    """
    centred = cost - cost.mean(dim=-1, keepdim=True)
    return centred / torch.sqrt(centred.square().mean(dim=-1, keepdim=True) + eps)


def _check_em_inputs(votes, activations, iterations):
    check_tensor("votes", votes, dims=4, floating=True, shape_doc="(B, I, J, H)")
    check_tensor("activations", activations, dims=2, floating=True, shape_doc="(B, I)")
    if activations.shape != votes.shape[:2]:
        raise ValueError(f"activations must be (B, I) = {tuple(votes.shape[:2])} to match votes (B, I, J, H); "
                         f"got {tuple(activations.shape)}")
    check_positive_int("iterations", iterations)


def _check_normalize(normalize):
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {normalize!r}")


def em_routing(votes: torch.Tensor, activations: torch.Tensor, beta_u, beta_a, iterations: int = 3,
               final_lambda: float = FINAL_LAMBDA, var_floor: float = VAR_FLOOR, eps: float = EPS,
               detach: bool = False, normalize: str = NORMALIZE, schedule: str = "ramp",
               renormalise_over_parents: bool = False):
    """EM routing of Hinton, Sabour & Frosst 2018, Procedure 1 (chapter 5, Eq. ch5-rprime to ch5-estep).

    ``R`` starts uniform (``1/J``); each of ``iterations`` rounds runs

    * the M-step: ``r'_ij = R_ij a_i``, ``mu_jh = sum_i r'_ij V_ijh / sum_i r'_ij``,
      ``sigma_jh^2 = sum_i r'_ij (V_ijh - mu_jh)^2 / sum_i r'_ij + var_floor``,
      ``cost_jh = (beta_u + log sigma_jh) sum_i r'_ij``,
      ``a'_j = sigmoid(lambda_t (beta_a - sum_h cost_jh))``, where with ``normalize="mean"`` (the
      book's default, Eq. ch5-costnorm) the amount of data ``sum_i r'_ij`` in the cost is divided
      by the number of children ``I``, so the cost does not grow with ``I`` and one ``lambda`` of
      order 1 serves every layer; ``normalize="none"`` is Procedure 1 as printed (then use a small
      ``final_lambda`` such as ``LITERAL_FINAL_LAMBDA``); ``normalize="std"`` standardises the
      summed costs over the parents (:func:`standardize_cost`);
    * the E-step, in log space:
      ``log p_ij = -sum_h [(V_ijh - mu_jh)^2 / (2 sigma_jh^2) + log(2 pi sigma_jh^2) / 2]``,
      ``R_ij = softmax_j(log a'_j + log p_ij)``;

    with ``lambda_t`` from :func:`inverse_temperatures` (``schedule``: ``"ramp"``, ``"constant"`` or ``"authors"``); every ``sum_i r'_ij`` that divides
    is clamped to at least ``eps`` (below it, ``mu`` tends to the plain mean of the votes). The loop is arranged so that the vote tensor is only read by
    matrix products (see ``_em``); chapter 5 checks it against the plain formulas.

    Args:
        votes: ``V (B, I, J, H)``, the vote of child ``i`` for parent ``j`` (a flattened 4x4 pose: H = 16).
        activations: ``a (B, I)`` of the children, in ``[0, 1]``.
        beta_u, beta_a: float or tensor broadcastable to ``(B, J)`` (learned per parent type in a layer).
        iterations: routing iterations ``>= 1``.
        final_lambda: the limit of the inverse-temperature schedule.
        var_floor: added to every variance; eps: the floor of every ``sum_i r'_ij`` that divides.
        normalize: ``"mean"``, ``"none"`` or ``"std"``: how the cost is scaled (see above).
        detach: if True, the assignments that enter the last M-step are constants for
            back-propagation (the idea of Gu & Tresp, chapter 4, carried over to EM):
            the gradient reaches the votes and activations only through that M-step.
        renormalise_over_parents: a pitfall of some public code, as a switch (never the default;
            chapter 5): ``r'_ij`` divided by its sum over the parents, ``max(a_i, eps)`` since
            ``sum_j R_ij = 1``, before each M-step. The children's activations then cancel, and a
            silent child's vote weighs as much as an active one's in every mean, variance and cost.

    Returns:
        ``(mu, a_out, R)``: parent poses ``(B, J, H)``, parent activations ``(B, J)`` and the
        assignments ``(B, I, J)`` of the last E-step (rows sum to 1 over ``J``), i.e. after
        the last M-step, as Procedure 1 leaves them.
    """
    _check_em_inputs(votes, activations, iterations)
    _check_normalize(normalize)
    mu, act, R = _em(votes.transpose(1, 2).contiguous(), activations, beta_u, beta_a, iterations,
                     final_lambda, var_floor, eps, final_e_step=True, detach=detach, normalize=normalize,
                     schedule=schedule, renormalise=renormalise_over_parents)
    return mu, act, R.transpose(1, 2)


def em_trace(votes: torch.Tensor, activations: torch.Tensor, beta_u, beta_a, iterations: int = 3,
             final_lambda: float = FINAL_LAMBDA, var_floor: float = VAR_FLOOR, eps: float = EPS,
             normalize: str = NORMALIZE, schedule: str = "ramp") -> list[EMState]:
    """Every iteration of :func:`em_routing` (for figures such as the paper's Fig. 2; chapter 5).

    Returns a list of ``iterations`` :class:`EMState` ``(mu, sigma2, a, R)`` with ``R (B, I, J)``
    from the E-step that follows each M-step; the last one's ``mu, a, R`` equal
    :func:`em_routing`'s result. Runs without a graph.
    """
    _check_em_inputs(votes, activations, iterations)
    _check_normalize(normalize)
    _check_schedule(schedule)
    out: list[EMState] = []
    with torch.no_grad():
        _em(votes.transpose(1, 2).contiguous(), activations, beta_u, beta_a, iterations, final_lambda,
            var_floor, eps, True, trace=out, normalize=normalize, schedule=schedule)
    return out


# ----------------------------------------------------------------------------- loss

def spread_loss(activations: torch.Tensor, target: torch.Tensor, margin: float) -> torch.Tensor:
    """Spread loss of Hinton et al. 2018, Sec. 3.1 (chapter 5, Eq. ch5-spread).

    ``L = sum_{j != t} max(0, m - (a_t - a_j))^2``, averaged over the batch.

    Args: ``activations (B, J)`` class activations, ``target (B,)`` integer labels, ``margin`` m.
    """
    check_tensor("activations", activations, dims=2, floating=True, shape_doc="(B, J)")
    check_tensor("target", target, dims=1)
    if target.is_floating_point() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class labels; got dtype {target.dtype}")
    if target.shape[0] != activations.shape[0]:
        raise ValueError(f"target must be (B,) with B = {activations.shape[0]}; got {tuple(target.shape)}")
    a_t = activations.gather(1, target.unsqueeze(1))
    gap = torch.relu(margin - (a_t - activations)) ** 2
    gap = gap.masked_fill(F.one_hot(target, activations.shape[1]).bool(), 0.0)
    return gap.sum(dim=1).mean()


def margin_at(step: int, total_steps: int, start: float = 0.2, end: float = 0.9) -> float:
    """The spread-loss margin raised linearly from ``start`` to ``end`` over training (Sec. 3.1; chapter 5)."""
    if total_steps <= 1:
        return end
    frac = min(max(step / (total_steps - 1), 0.0), 1.0)
    return start + (end - start) * frac


class SpreadLoss:
    """``loss_fn(model, x, y) -> (loss, activations)`` for :func:`capslib.train.fit`, with the
    margin schedule of :func:`margin_at` advanced once per call (one training step)."""

    def __init__(self, total_steps: int, start: float = 0.2, end: float = 0.9):
        check_positive_int("total_steps", total_steps)
        self.total_steps, self.start, self.end, self.step = total_steps, start, end, 0

    @property
    def margin(self) -> float:
        return margin_at(self.step, self.total_steps, self.start, self.end)

    def __call__(self, model, x, y):
        out = model(x)
        loss = spread_loss(out.activations.float(), y, self.margin)
        self.step += 1
        return loss, out.activations
