"""Capsule non-linearities and the margin loss (chapter 1); the routing contractions.

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
    # the range check reads two numbers back to the host: not while a CUDA graph is being captured
    # (capslib.engine.steps), where a host read cannot be recorded and the replays run no Python anyway
    capturing = target.is_cuda and torch.cuda.is_current_stream_capturing()
    if target.numel() and not capturing and (int(target.min()) < 0 or int(target.max()) >= J):
        raise ValueError(f"target labels must lie in [0, {J}); got range [{int(target.min())}, {int(target.max())}]")
    t = torch.zeros_like(lengths).scatter_(1, target.reshape(len(target), -1), 1.0)
    pos = t * torch.relu(m_pos - lengths) ** 2
    neg = lam * (1.0 - t) * torch.relu(lengths - m_neg) ** 2
    return (pos + neg).sum(dim=1).mean()


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)``; a matrix times a column (``P = 1``) goes as the column times the matrix, both
    transposed: the same dot products, equal to rounding, and on 2 cores 3-9 times faster for chapter 2's
    ``ci`` votes (640 x 288 x 16)."""
    if b.shape[2] == 1 and a.shape[1] > 1:
        return torch.bmm(b.transpose(1, 2), a.transpose(1, 2)).transpose(1, 2)
    return torch.bmm(a, b)


class _Bmm(torch.autograd.Function):
    """``torch.bmm`` whose backward pass forms an outer product by broadcasting (see :func:`bmm`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return _bmm(a, b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:      # g @ b^T, a sum over the P columns of the output
            ga = g * b.transpose(1, 2) if b.shape[2] == 1 else torch.bmm(g, b.transpose(1, 2))
        if ctx.needs_input_grad[1]:      # a^T @ g, a sum over the M rows of the output
            gb = a.transpose(1, 2) * g if a.shape[1] == 1 else _bmm(a.transpose(1, 2), g)
        return ga, gb


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` for ``a (N, M, K)`` and ``b (N, K, P)``, with a faster backward pass on CPU.

    Routing contracts votes with one weight per vote (``s_j = sum_i c_ij u_hat_{j|i}``,
    the EM M-step) or with one vector per parent (the agreement, the EM E-step): products
    with ``M = 1`` or ``P = 1``. Their gradient with respect to the votes is then an outer
    product, which ``torch.bmm``'s backward computes as a matrix product with inner dimension 1;
    here it is a broadcasting multiplication. Every entry of an outer product is a single
    product, so both ways give the same bits (``tests/test_core.py`` checks it; docs/measurements.md lists the
    chapter executions compared); forward values and the other gradient are :func:`_bmm`'s.
    FLOP counters (``torch.utils.flop_counter``) no longer count those outer products.
    Measured on 2 cores (AMD EPYC, torch 2.13, with :func:`capslib.book.session.keep_freed_memory`), a
    training step of chapter 5's ``ci`` EM network took 48-54 ms instead of 52-61 ms, and one of
    chapter 2's ``ci`` CapsNet 48 ms instead of 51 ms. Under autocast the
    inputs are cast to its dtype first, as ``torch.bmm`` would be.
    """
    check_tensor("a", a, dims=3, floating=True, shape_doc="(N, M, K)")
    check_tensor("b", b, dims=3, floating=True, shape_doc="(N, K, P)")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm needs a (N, M, K) and b (N, K, P) with the same N and K; "
                         f"got a {tuple(a.shape)} and b {tuple(b.shape)}")
    device = a.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        a, b = a.to(dtype), b.to(dtype)
    return _Bmm.apply(a, b)


# ----------------------------------------------------------------------------- one tensor, many reads

class _Gather(torch.autograd.Function):
    """Identity on ``x``; its backward pass sums, with one batched product, the outer products that this
    backward pass's :class:`_Read` nodes left in ``book`` (a pass that stopped short of ``x``, with the
    graph retained, may have left its own: they carry another graph-task id)."""

    @staticmethod
    def forward(ctx, x, book):
        ctx.book = book
        ctx.set_materialize_grads(False)   # the reads leave their parts in the book, not as gradients
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        task = torch._C._current_graph_task_id()
        mine = [(u, z) for t, u, z in ctx.book if t == task]
        ctx.book.clear()
        if not mine:
            return g, None
        left = torch.cat([u for u, _ in mine], dim=1)     # (N, n, K): the reads' column factors, as rows
        gx = torch.bmm(left.transpose(1, 2), torch.cat([z for _, z in mine], dim=1))   # rows (N, n, P)
        return (gx if g is None else g + gx), None


class _Read(torch.autograd.Function):
    """``torch.bmm(a, b)`` with the gathered tensor as ``a`` (``x_on_left``) or ``b``; its part of the
    tensor's gradient goes to the book as the two factors of an outer product."""

    @staticmethod
    def forward(ctx, a, b, book, x_on_left):
        ctx.save_for_backward(a, b)
        ctx.book, ctx.x_on_left = book, x_on_left
        return _bmm(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        task = torch._C._current_graph_task_id()
        if ctx.x_on_left:                  # x @ z: x gets g z^T, z gets x^T g
            ctx.book.append((task, g.transpose(1, 2), b.transpose(1, 2)))
            return None, _bmm(a.transpose(1, 2), g) if ctx.needs_input_grad[1] else None, None, None
        ctx.book.append((task, a, g))      # w @ x: x gets w^T g, w gets g x^T
        return torch.bmm(g, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None, None, None, None


class Reads:
    """A tensor ``x (N, K, P)`` that a loop reads through products with one thin factor each: a routing
    pass's votes, read per iteration by weighted sums (:meth:`weigh`) and agreements (:meth:`project`).

    Each read's gradient for ``x`` is an outer product, and ``x``'s gradient their sum. :func:`bmm` forms
    the terms one by one, each writing a tensor of ``x``'s size; here each read leaves its two factors in a
    book, and the sum is one batched product (inner dimension: the number of reads), formed once when
    back-propagation reaches ``x``. Values and the factors' gradients are :func:`bmm`'s; ``x``'s gradient
    is the same sum in another rounding order (``tests/test_core.py``, ``tests/test_em.py``). Used by
    :mod:`capslib.em` and :mod:`capslib.routing` (speeds in docs/measurements.md). Without a graph, or under
    ``torch.compile`` (whose tracer would not follow the book), the reads are plain :func:`bmm`; under
    autocast ``x`` is cast once, each factor per read.
    """

    def __init__(self, x: torch.Tensor):
        check_tensor("x", x, dims=3, floating=True, shape_doc="(N, K, P)")
        dev = x.device.type
        self._dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        self._book: list = []
        self._gathered = x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        x = x.to(self._dtype)
        self.x = _Gather.apply(x, self._book) if self._gathered else x

    def _read(self, name, factor, shape, x_on_left):
        factor = factor.to(self._dtype)
        if factor.dim() != 3 or tuple(factor.shape) != shape:
            raise ValueError(f"{name} needs a factor of shape {shape}; got {tuple(factor.shape)}")
        a, b = (self.x, factor) if x_on_left else (factor, self.x)
        return _Read.apply(a, b, self._book, x_on_left) if self._gathered else bmm(a, b)

    def weigh(self, w: torch.Tensor) -> torch.Tensor:
        """``w (N, 1, K) @ x`` -> ``(N, 1, P)``: one weight per row of ``x``."""
        return self._read("weigh", w, (self.x.shape[0], 1, self.x.shape[1]), False)

    def project(self, z: torch.Tensor) -> torch.Tensor:
        """``x @ z`` for ``z (N, P, 1)`` -> ``(N, K, 1)``: one vector per matrix of ``x``."""
        return self._read("project", z, (self.x.shape[0], self.x.shape[2], 1), True)
