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
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .checks import check_positive_int, check_tensor
from .ops import bmm

FINAL_LAMBDA = 1.0    # lambda of the last routing iteration, for normalised costs (the paper gives no value)
LITERAL_FINAL_LAMBDA = 0.03   # a workable lambda for the literal (unnormalised) cost at the ci network's scale
NORMALIZE = "mean"    # how the M-step's cost is scaled before the sigmoid: "mean", "none" or "std"
NORMALIZATIONS = ("mean", "none", "std")
W_INIT_STD = 0.02     # transformation matrices start at identity + W_INIT_STD * N(0, 1) (chapter 5)
STD_EPS = 1e-4        # inside the square root of the standard deviation of the costs
VAR_FLOOR = 1e-4      # added to every sigma_h^2
EPS = 1e-6            # floor of every sum of assignments sum_i r'_ij



# ----------------------------------------------------------------------------- routing

SCHEDULES = ("ramp", "constant")


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
    iterations, and only their number differs (chapter 5's iteration study).
    """
    check_positive_int("iterations", iterations)
    if not final_lambda > 0:
        raise ValueError(f"final_lambda must be > 0; got {final_lambda}")
    _check_schedule(schedule)
    if schedule == "constant":
        return [float(final_lambda)] * iterations
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
        detach=False, normalize="mean", schedule="ramp"):
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
    VV = torch.cat([V, V2], dim=-1)                            # one matrix product per step reads both
    a = a.unsqueeze(1)                                         # (B, 1, I)
    R = Vt.new_full((B, J, I), 1.0 / J)                        # Procedure 1, line 1
    for t, lam in enumerate(inverse_temperatures(iterations, final_lambda, schedule)):
        # with detach, only the last M-step (and E-step) is recorded for back-propagation:
        # the assignments R it starts from are constants, as in Gu & Tresp's detached routing
        grad = not detach or t == iterations - 1
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            mu, sigma2, logit, R = _em_round(V, V2, a, R, bu, ba, lam, var_floor, eps,
                                             t < iterations - 1 or final_e_step, normalize, VV)
        if trace is not None:
            trace.append(EMState(mu + shift.squeeze(2), sigma2, torch.sigmoid(logit), R.transpose(1, 2)))
    return mu + shift.squeeze(2), torch.sigmoid(logit), R


def _em_round(V, V2, a, R, bu, ba, lam, var_floor, eps, do_e_step, normalize="mean", VV=None):
    """One M-step and (if ``do_e_step``) one E-step on centred votes ``V (B, J, I, H)``.

    ``VV`` is ``cat([V, V2], -1)`` when the caller has it: then each step reads the vote
    tensor with a single batched matrix product instead of two (:func:`capslib.ops.bmm`, whose
    backward pass forms the votes' gradient, an outer product, without a matrix product).
    """
    H = V.shape[-1]
    # M-step
    rp = R * a                                             # r'_ij = R_ij a_i
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
        mu, ex2 = bmm(wr.reshape(B * J, 1, I), VV.reshape(B * J, I, 2 * H)).view(B, J, 2 * H).split(H, dim=-1)
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
            quad = bmm(VV.reshape(B * J, I, 2 * H), z.reshape(B * J, 2 * H, 1)).view(B, J, I)
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
               detach: bool = False, normalize: str = NORMALIZE, schedule: str = "ramp"):
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

    with ``lambda_t`` from :func:`inverse_temperatures` (``schedule``: ``"ramp"`` or ``"constant"``); every ``sum_i r'_ij`` that divides
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

    Returns:
        ``(mu, a_out, R)``: parent poses ``(B, J, H)``, parent activations ``(B, J)`` and the
        assignments ``(B, I, J)`` of the last E-step (rows sum to 1 over ``J``), i.e. after
        the last M-step, as Procedure 1 leaves them.
    """
    _check_em_inputs(votes, activations, iterations)
    _check_normalize(normalize)
    mu, act, R = _em(votes.transpose(1, 2).contiguous(), activations, beta_u, beta_a, iterations,
                     final_lambda, var_floor, eps, final_e_step=True, detach=detach, normalize=normalize,
                     schedule=schedule)
    return mu, act, R.transpose(1, 2)


def em_trace(votes: torch.Tensor, activations: torch.Tensor, beta_u, beta_a, iterations: int = 3,
             final_lambda: float = FINAL_LAMBDA, var_floor: float = VAR_FLOOR, eps: float = EPS,
             normalize: str = NORMALIZE) -> list[EMState]:
    """Every iteration of :func:`em_routing` (for figures such as the paper's Fig. 2; chapter 5).

    Returns a list of ``iterations`` :class:`EMState` ``(mu, sigma2, a, R)`` with ``R (B, I, J)``
    from the E-step that follows each M-step; the last one's ``mu, a, R`` equal
    :func:`em_routing`'s result. Runs without a graph.
    """
    _check_em_inputs(votes, activations, iterations)
    _check_normalize(normalize)
    out: list[EMState] = []
    with torch.no_grad():
        _em(votes.transpose(1, 2).contiguous(), activations, beta_u, beta_a, iterations, final_lambda,
            var_floor, eps, True, trace=out, normalize=normalize)
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


# ----------------------------------------------------------------------------- layers

class PrimaryMatrixCaps(nn.Module):
    """Primary matrix capsules (Hinton et al. 2018, Sec. 4; chapter 5).

    A 1x1 convolution gives, at every position, ``types`` 4x4 pose matrices and
    ``types`` logistic activations.

    ``x (B, C, H, W)`` -> ``pose (B, H, W, T, 4, 4)``, ``a (B, H, W, T)``.
    """

    def __init__(self, in_channels: int, types: int = 32, pose: int = 4):
        super().__init__()
        for name, v in [("in_channels", in_channels), ("types", types), ("pose", pose)]:
            check_positive_int(name, v)
        self.in_channels, self.types, self.p = in_channels, types, pose
        self.pose = nn.Conv2d(in_channels, types * pose * pose, 1)
        self.act = nn.Conv2d(in_channels, types, 1)

    def forward(self, x: torch.Tensor):
        check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"x must be (B, {self.in_channels}, H, W); got {tuple(x.shape)}")
        B, _, H, W = x.shape
        pose = self.pose(x).view(B, self.types, self.p, self.p, H, W).permute(0, 4, 5, 1, 2, 3)
        a = torch.sigmoid(self.act(x)).permute(0, 2, 3, 1)
        return pose.contiguous(), a.contiguous()


def _check_caps(pose, a, types, p):
    check_tensor("pose", pose, dims=6, floating=True, shape_doc="(B, H, W, T, 4, 4)")
    check_tensor("a", a, dims=4, floating=True, shape_doc="(B, H, W, T)")
    if pose.shape[3:] != (types, p, p) or a.shape != pose.shape[:4]:
        raise ValueError(f"pose must be (B, H, W, {types}, {p}, {p}) and a (B, H, W, {types}); "
                         f"got {tuple(pose.shape)} and {tuple(a.shape)}")


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32; float32 and float64 (the derivation checks) unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class MatrixCaps(nn.Module):
    """Base of the routed matrix-capsule layers (Hinton et al. 2018; chapter 5).

    Holds the transformation matrices ``W (I_w, J, 4, 4)``, the learned ``beta_u`` and
    ``beta_a`` (one per parent type, shape ``(J,)``), and routes votes ``V = M W`` with
    :func:`em_routing`. Subclasses decide which children vote (a patch, or every position).
    """

    def __init__(self, in_types: int, out_types: int, weight_rows: int, iterations: int = 3, pose: int = 4,
                 final_lambda: float = FINAL_LAMBDA, init_std: float = W_INIT_STD, detach: bool = False,
                 normalize: str = NORMALIZE, schedule: str = "ramp"):
        super().__init__()
        for name, v in [("in_types", in_types), ("out_types", out_types), ("iterations", iterations), ("pose", pose)]:
            check_positive_int(name, v)
        self.in_types, self.out_types, self.p = in_types, out_types, pose
        self.iterations, self.final_lambda, self.detach = iterations, final_lambda, detach
        _check_normalize(normalize)
        self.normalize = normalize
        self.W = nn.Parameter(torch.eye(pose) + init_std * torch.randn(weight_rows, out_types, pose, pose))
        self.init_std = init_std
        self.beta_u = nn.Parameter(torch.zeros(out_types))
        self.beta_a = nn.Parameter(torch.zeros(out_types))
        _check_schedule(schedule)
        self.schedule = schedule   # of the inverse temperature (inverse_temperatures)

    def route(self, votes: torch.Tensor, a: torch.Tensor, iterations: int | None = None):
        """``votes (N, J, I, 4, 4)`` (parent-major), ``a (N, I)`` -> ``mu (N, J, 4, 4)``, ``a' (N, J)``.

        Runs :func:`em_routing` without its last E-step (its assignments are not used).
        """
        N, J, I = votes.shape[:3]
        # EM (variances, logs, logsumexp) runs in float32 even when the votes come from a bf16
        # autocast region (the full profile on CUDA): bf16 keeps 8 bits of mantissa.
        with torch.autocast(device_type=votes.device.type, enabled=False):
            Vt, a = _at_least_float32(votes.reshape(N, J, I, -1)), _at_least_float32(a)
            if getattr(self, "_calibrating", False):
                self._calibrate(Vt, a)
            mu, act, _ = _em(Vt, a, self.beta_u, self.beta_a, iterations or self.iterations,
                             self.final_lambda, VAR_FLOOR, EPS, final_e_step=False, detach=self.detach,
                             normalize=self.normalize, schedule=self.schedule)
        return mu.view(N, J, self.p, self.p), act

    @torch.no_grad()
    def _calibrate(self, Vt: torch.Tensor, a: torch.Tensor) -> None:
        """Data-dependent start: ``beta_u = -mean log sigma`` of the first M-step, so costs start near 0."""
        B, J, I, H = Vt.shape
        R = Vt.new_full((B, J, I), 1.0 / J)
        V = Vt - Vt.mean(dim=2, keepdim=True)
        zero = Vt.new_zeros(())
        _, sigma2, _, _ = _em_round(V, V * V, a.unsqueeze(1), R, zero, zero, 1.0, VAR_FLOOR, EPS, False,
                                    self.normalize)
        self.beta_u.copy_(-0.5 * torch.log(sigma2).mean(dim=(0, 2)))
        self.beta_a.zero_()

    def extra_repr(self) -> str:
        return (f"in_types={self.in_types}, out_types={self.out_types}, iterations={self.iterations}"
                + (f", schedule={self.schedule!r}" if self.schedule != "ramp" else ""))


class ConvCaps(MatrixCaps):
    """Convolutional matrix capsules with EM routing (Hinton et al. 2018, Sec. 4; chapter 5).

    Every ``K x K`` patch (stride ``s``) of the child grid is unfolded into
    ``I = K*K*T_in`` children; each votes ``V = M W`` for the ``T_out`` parent types at
    that position (``W (K*K*T_in, T_out, 4, 4)`` shared over positions), and all patches
    are routed at once as one batch of size ``B*H'*W'``. A child that falls into several
    overlapping patches is routed separately in each (its assignments sum to 1 within
    a patch), a common simplification of the paper's routing.

    ``pose (B, H, W, T_in, 4, 4)``, ``a (B, H, W, T_in)`` -> the same layout with
    ``H' = (H - K) // s + 1`` and ``T_out`` types.
    """

    def __init__(self, in_types: int, out_types: int, kernel_size: int = 3, stride: int = 1, iterations: int = 3,
                 pose: int = 4, final_lambda: float = FINAL_LAMBDA, detach: bool = False, normalize: str = NORMALIZE,
                 init_std: float = W_INIT_STD, schedule: str = "ramp"):
        check_positive_int("kernel_size", kernel_size)
        check_positive_int("stride", stride)
        super().__init__(in_types, out_types, kernel_size * kernel_size * in_types, iterations, pose, final_lambda,
                         init_std=init_std, detach=detach, normalize=normalize, schedule=schedule)
        self.k, self.s = kernel_size, stride

    def forward(self, pose: torch.Tensor, a: torch.Tensor, iterations: int | None = None):
        _check_caps(pose, a, self.in_types, self.p)
        B, H, W = pose.shape[:3]
        if H < self.k or W < self.k:
            raise ValueError(f"the capsule grid {H}x{W} is smaller than the kernel {self.k}x{self.k}")
        k, s, T, p = self.k, self.s, self.in_types, self.p
        # (B, H', W', T, p, p, k, k) -> (B*H'*W', k*k*T, p, p): strided views, then one copy
        pp = pose.unfold(1, k, s).unfold(2, k, s)
        Ho, Wo = pp.shape[1], pp.shape[2]
        pp = pp.permute(0, 1, 2, 6, 7, 3, 4, 5).reshape(B * Ho * Wo, k * k * T, p, p)
        aa = a.unfold(1, k, s).unfold(2, k, s).permute(0, 1, 2, 4, 5, 3).reshape(B * Ho * Wo, k * k * T)
        votes = torch.einsum("nipq,ijqr->njipr", pp, self.W.to(pose.dtype))      # V_ij = M_i W_ij
        mu, act = self.route(votes, aa, iterations)
        return mu.view(B, Ho, Wo, self.out_types, p, p), act.view(B, Ho, Wo, self.out_types)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kernel_size={self.k}, stride={self.s}"


class ClassCaps(MatrixCaps):
    """Class capsules with shared transforms and coordinate addition (Hinton et al. 2018, Sec. 4; chapter 5).

    Every child of type ``t`` at every grid position votes with the same ``W_t``; the
    scaled coordinates ``((row + 0.5) / H, (col + 0.5) / W)`` of its position are added to
    the first two entries of the right-hand column of its vote (entries ``[0, 3]`` and
    ``[1, 3]``), so the votes keep where their child was.

    ``pose (B, H, W, T, 4, 4)``, ``a (B, H, W, T)`` -> ``mu (B, J, 4, 4)``, ``a' (B, J)``.
    """

    def __init__(self, in_types: int, classes: int = 10, iterations: int = 3, pose: int = 4,
                 final_lambda: float = FINAL_LAMBDA, coordinate_addition: bool = True, detach: bool = False,
                 normalize: str = NORMALIZE, init_std: float = W_INIT_STD, schedule: str = "ramp"):
        super().__init__(in_types, classes, in_types, iterations, pose, final_lambda, init_std=init_std,
                         detach=detach, normalize=normalize, schedule=schedule)
        self.coordinate_addition = coordinate_addition

    def votes(self, pose: torch.Tensor, a: torch.Tensor):
        """``pose (B, H, W, T, 4, 4)``, ``a (B, H, W, T)`` -> votes ``(B, J, I, 4, 4)`` (parent-major,
        coordinates added) and child activations ``(B, I)`` with ``I = H*W*T``."""
        _check_caps(pose, a, self.in_types, self.p)
        B, H, W, T, p = *pose.shape[:4], self.p
        votes = torch.einsum("bxytpq,tjqr->bjxytpr", pose, self.W.to(pose.dtype))
        if self.coordinate_addition:
            rows = (torch.arange(H, device=pose.device, dtype=pose.dtype) + 0.5) / H
            cols = (torch.arange(W, device=pose.device, dtype=pose.dtype) + 0.5) / W
            coord = pose.new_zeros(H, W, p, p)
            coord[:, :, 0, p - 1] = rows[:, None]
            coord[:, :, 1, p - 1] = cols[None, :]
            votes = votes + coord[None, None, :, :, None]
        return votes.reshape(B, self.out_types, H * W * T, p, p), a.reshape(B, H * W * T)

    def forward(self, pose: torch.Tensor, a: torch.Tensor, iterations: int | None = None):
        return self.route(*self.votes(pose, a), iterations)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", coordinate_addition={self.coordinate_addition}"


# ----------------------------------------------------------------------------- model

class EMOutput(NamedTuple):
    activations: torch.Tensor   # (B, J) class-capsule activations (the scores)
    poses: torch.Tensor         # (B, J, 4, 4) class-capsule poses


class EMCapsNet(nn.Module):
    """The matrix-capsule network of Hinton et al. 2018, Fig. 1 (chapter 5).

    Conv1 (``A`` channels, 5x5, stride 2; BatchNorm, then ReLU) -> PrimaryCaps (``B`` types, 1x1) ->
    ConvCaps1 (``C`` types, K = 3, stride 2) -> ConvCaps2 (``D`` types, K = 3, stride 1) ->
    Class capsules (``classes``, shared transforms, coordinate addition). The paper's
    network has ``A = B = C = D = 32``. Any input side that leaves a grid of at least
    3x3 after ConvCaps1 works, since the class capsules share their transforms over
    positions. ``schedule`` is the inverse temperature's schedule in every routed layer
    (:func:`inverse_temperatures`).

    ``forward(x (B, C_in, H, W))`` -> :class:`EMOutput` ``(activations (B, J), poses (B, J, 4, 4))``.
    """

    def __init__(self, in_channels: int = 1, A: int = 32, B: int = 32, C: int = 32, D: int = 32, classes: int = 10,
                 iterations: int = 3, conv_kernel: int = 5, conv_stride: int = 2,
                 final_lambda: float = FINAL_LAMBDA, coordinate_addition: bool = True, detach: bool = False,
                 normalize: str = NORMALIZE, batch_norm: bool = True, init_std: float = W_INIT_STD,
                 schedule: str = "ramp"):
        super().__init__()
        for name, v in [("in_channels", in_channels), ("A", A), ("B", B), ("C", C), ("D", D),
                        ("classes", classes)]:
            check_positive_int(name, v)
        self.in_channels, self.classes = in_channels, classes
        self.conv1 = nn.Conv2d(in_channels, A, conv_kernel, conv_stride)
        self.bn1 = nn.BatchNorm2d(A) if batch_norm else nn.Identity()
        self.primary = PrimaryMatrixCaps(A, B)
        kw = dict(final_lambda=final_lambda, detach=detach, normalize=normalize, init_std=init_std, schedule=schedule)
        self.conv_caps1 = ConvCaps(B, C, 3, 2, iterations, **kw)
        self.conv_caps2 = ConvCaps(C, D, 3, 1, iterations, **kw)
        self.class_caps = ClassCaps(D, classes, iterations, coordinate_addition=coordinate_addition, **kw)

    @property
    def iterations(self) -> int:
        return self.class_caps.iterations

    @iterations.setter
    def iterations(self, value: int) -> None:
        check_positive_int("iterations", value)
        for layer in (self.conv_caps1, self.conv_caps2, self.class_caps):
            layer.iterations = value

    def capsules(self, x: torch.Tensor):
        """Every capsule layer's ``(pose, a)``, from primary to the last ConvCaps (for figures)."""
        check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"x must be (B, {self.in_channels}, H, W); got {tuple(x.shape)}")
        out = [self.primary(torch.relu(self.bn1(self.conv1(x))))]
        out.append(self.conv_caps1(*out[-1]))
        out.append(self.conv_caps2(*out[-1]))
        return out

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor) -> "EMCapsNet":
        """Data-dependent initialisation on a batch ``x``: each routed layer, in order, sets
        ``beta_u`` to minus the mean ``log sigma`` of its first M-step and ``beta_a`` to 0, so
        every ``sum_h cost_h`` starts near 0 and no activation starts saturated."""
        layers = (self.conv_caps1, self.conv_caps2, self.class_caps)
        for layer in layers:
            layer._calibrating = True
        try:
            with torch.no_grad():  # statistics only: no graph (it would hold every vote of x)
                self(x)
        finally:
            for layer in layers:
                layer._calibrating = False
        return self

    def forward(self, x: torch.Tensor) -> EMOutput:
        pose, a = self.capsules(x)[-1]
        mu, act = self.class_caps(pose, a)
        return EMOutput(act, mu)


# ----------------------------------------------------------------------------- viewpoint baseline

class SmallConvNet(nn.Module):
    """The CNN baseline of chapter 5's viewpoint test, sized by one ``width``: Conv 5x5 stride 2
    (``width`` channels, ReLU) -> Conv 3x3 stride 2 (``2 width``, ReLU) -> one linear layer to the
    classes. With the EM network's own first layer and stride, its size is set by
    :func:`matched_width` to the EM network's parameter count (the paper compared capsules with a
    CNN baseline; here the two are matched in size so that capacity is not the difference).

    ``forward(x (B, C_in, H, W))`` -> class scores ``(B, classes)``; any side of at least 11 pixels works
    (global average pooling before the linear layer)."""

    def __init__(self, width: int, in_channels: int = 1, classes: int = 10):
        super().__init__()
        for name, v in [("width", width), ("in_channels", in_channels), ("classes", classes)]:
            check_positive_int(name, v)
        self.in_channels = in_channels
        self.features = nn.Sequential(nn.Conv2d(in_channels, width, 5, 2), nn.ReLU(),
                                      nn.Conv2d(width, 2 * width, 3, 2), nn.ReLU(),
                                      nn.Conv2d(2 * width, 4 * width, 3, 1), nn.ReLU())
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"x must be (B, {self.in_channels}, H, W); got {tuple(x.shape)}")
        return self.head(self.features(x).mean(dim=(2, 3)))


def matched_width(target_params: int, in_channels: int = 1, classes: int = 10) -> int:
    """The ``width`` of :class:`SmallConvNet` whose parameter count is nearest ``target_params``
    (counted on built networks; the count grows with the width, so the search stops past the target)."""
    check_positive_int("target_params", target_params)

    def count(w):
        return sum(p.numel() for p in SmallConvNet(w, in_channels, classes).parameters())

    w, below = 1, count(1)
    while below < target_params:
        above = count(w + 1)
        if above >= target_params:
            return w if target_params - below <= above - target_params else w + 1
        w, below = w + 1, above
    return w
