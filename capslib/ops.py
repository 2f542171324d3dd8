"""Capsule non-linearities and the margin loss (chapter 1).

Shapes follow the book's letters: ``B`` batch, ``I`` input capsules,
``J`` output capsules, ``D`` capsule dimension.
"""
from __future__ import annotations

import torch

from .checks import check_tensor

# Added under the square root of ||s||^2 so that the gradient of squash stays
# finite at s = 0. It is far below float32 resolution of any norm we meet
# (sqrt(1e-20) = 1e-10), so values are unchanged to working precision.
_EPS = 1e-20


def squash(s: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Squash a capsule vector to length below 1 (Sabour et al. 2017, Eq. 1; chapter 1).

    ``v = ||s||^2 / (1 + ||s||^2) * s / ||s||``. The direction of ``s`` is kept and
    the length ``n`` is mapped to ``n^2 / (1 + n^2)`` in ``[0, 1)``. The gradient
    at ``s = 0`` is finite (it is 0, the true derivative there).

    Args:
        s: any tensor; the capsule vectors lie along ``dim``, e.g. ``(B, J, D)``.
        dim: the axis that holds the capsule's components.
    """
    check_tensor("s", s, min_dim=1)
    n2 = (s * s).sum(dim=dim, keepdim=True)
    return s * (n2 / ((1.0 + n2) * torch.sqrt(n2 + _EPS)))


def unsquash(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`squash` for vectors of length below 1 (Hauser, Eq. 6; chapters 1 and 7).

    A squashed vector of length ``m`` came from a vector of length
    ``sqrt(m / (1 - m))`` in the same direction.

    Raises:
        ValueError: if any vector along ``dim`` has length ``>= 1``.
    """
    check_tensor("x", x, min_dim=1)
    m = torch.linalg.vector_norm(x, dim=dim, keepdim=True)
    if bool((m >= 1).any()):
        raise ValueError(
            f"unsquash needs every vector of x to have length < 1 along dim={dim}; "
            f"the largest has length {m.max().item():.4g}"
        )
    m = m.clamp_min(_EPS)
    return x / torch.sqrt(m * (1.0 - m))


def margin_loss(
    lengths: torch.Tensor,
    target: torch.Tensor,
    m_pos: float = 0.9,
    m_neg: float = 0.1,
    lam: float = 0.5,
) -> torch.Tensor:
    """Margin loss of Sabour et al. 2017, Eq. 4 (chapter 1).

    ``L_k = T_k max(0, m+ - ||v_k||)^2 + lam (1 - T_k) max(0, ||v_k|| - m-)^2``,
    summed over the classes ``k`` and averaged over the batch.

    Args:
        lengths: ``(B, J)`` capsule lengths in ``[0, 1)``.
        target: ``(B,)`` integer class labels in ``[0, J)``, or ``(B, K)`` when every image holds
            ``K`` objects (MultiMNIST, chapter 2): each listed class has ``T_k = 1``.
    """
    check_tensor("lengths", lengths, dims=2, floating=True)
    check_tensor("target", target, min_dim=1)
    if target.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise TypeError(f"target must hold integer class labels; got dtype {target.dtype}")
    if target.dim() > 2 or target.shape[0] != lengths.shape[0]:
        raise ValueError(
            f"target must be (B,) or (B, K) with B = {lengths.shape[0]} to match lengths (B, J); "
            f"got {tuple(target.shape)}"
        )
    J = lengths.shape[1]
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= J):
        raise ValueError(f"target labels must lie in [0, {J}); got range [{int(target.min())}, {int(target.max())}]")
    t = torch.zeros_like(lengths).scatter_(1, target.reshape(len(target), -1), 1.0)
    pos = t * torch.relu(m_pos - lengths) ** 2
    neg = lam * (1.0 - t) * torch.relu(lengths - m_neg) ** 2
    return (pos + neg).sum(dim=1).mean()
