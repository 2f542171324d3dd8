"""Matrix-capsule layers and networks with EM routing (Hinton, Sabour & Frosst 2018; chapter 5).

The layers of the paper's Fig. 1, each routing with :mod:`capslib.em`: primary matrix capsules
(:class:`PrimaryMatrixCaps`), convolutional capsules (:class:`ConvCaps`) and class capsules with
coordinate addition (:class:`ClassCaps`), both built on :class:`MatrixCaps`; the network
:class:`EMCapsNet` that stacks them. (The size-matched CNN of chapter 5's viewpoint test is in
:mod:`capslib.book.ch05`.)

A child's pose ``M`` (4x4) votes ``V_ij = M_i W_ij`` for parent ``j``; the transformation matrices
start at ``identity + W_INIT_STD * N(0, 1)`` and ``beta_u``, ``beta_a`` (one per parent type) at 0,
or at the data-dependent start of :meth:`EMCapsNet.calibrate`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .checks import check_positive_int, check_tensor
from .em import EPS, FINAL_LAMBDA, NORMALIZE, VAR_FLOOR, _check_normalize, _check_schedule, _em, _em_round

W_INIT_STD = 0.02     # transformation matrices start at identity + W_INIT_STD * N(0, 1) (chapter 5)


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
    :func:`capslib.em.em_routing`. Subclasses decide which children vote (a patch, or every position).
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
        # the pitfall of capslib.em.em_routing: off; switched on a trained layer (EMCapsNet.renormalise_over_parents)
        self.renormalise_over_parents = False

    def route(self, votes: torch.Tensor, a: torch.Tensor, iterations: int | None = None):
        """``votes (N, J, I, 4, 4)`` (parent-major), ``a (N, I)`` -> ``mu (N, J, 4, 4)``, ``a' (N, J)``.

        Runs :func:`capslib.em.em_routing` without its last E-step (its assignments are not used).
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
                             normalize=self.normalize, schedule=self.schedule,
                             renormalise=self.renormalise_over_parents)
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
                + (f", schedule={self.schedule!r}" if self.schedule != "ramp" else "")
                + (", renormalise_over_parents=True" if self.renormalise_over_parents else ""))


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
    (:func:`capslib.em.inverse_temperatures`).

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

    @property
    def renormalise_over_parents(self) -> bool:
        """The routing pitfall of :func:`capslib.em.em_routing` in every routed layer (off by default;
        chapter 5 switches it on a trained network)."""
        return self.class_caps.renormalise_over_parents

    @renormalise_over_parents.setter
    def renormalise_over_parents(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"renormalise_over_parents must be a bool; got {value!r}")
        for layer in (self.conv_caps1, self.conv_caps2, self.class_caps):
            layer.renormalise_over_parents = value

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
