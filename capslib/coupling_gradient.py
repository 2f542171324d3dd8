"""The coupling-gradient argument of Gu & Tresp (2020, supplementary Appx. A and C; chapter 4).

Dynamic routing makes the couplings ``c`` functions of the votes ``u_hat``. The
gradient of a loss with respect to a vote therefore has two parts (their Eq. 1):
a *direct* term, through ``s_j = sum_i c_ij u_hat_{j|i}`` with ``c`` held fixed,
and a term *through the couplings*. Gu & Tresp argue the second term is small and
drop it ("detached" routing). This module computes both terms by hand, measures
their ratio on a model, summarises how polarized the couplings are, and turns a
real autograd graph into a :mod:`networkx` graph that can be drawn.

Shapes use the book's letters: ``B`` batch, ``I`` input capsules, ``J`` output
capsules, ``D`` output capsule dimension.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from .checks import check_positive_int, check_tensor
from .ops import squash

CHAPTER = "04_coupling_gradient_proof"



# ----------------------------------------------------------------------------- routing with a logit scale

def _check_votes(u_hat):
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")


def _check_grad_v(u_hat, grad_v):
    check_tensor("grad_v", grad_v, dims=3, floating=True, shape_doc="(B, J, D)")
    B, _, J, D = u_hat.shape
    if tuple(grad_v.shape) != (B, J, D):
        raise ValueError(f"grad_v must be (B, J, D) = ({B}, {J}, {D}) to match u_hat; got {tuple(grad_v.shape)}")


def _check_scale(logit_scale):
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not logit_scale > 0:
        raise ValueError(f"logit_scale must be a number > 0; got {logit_scale!r}")


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


def gradient_terms(u_hat: torch.Tensor, grad_v: torch.Tensor, iterations: int = 3, logit_scale: float = 1.0):
    """The two terms of ``dL/du_hat`` (Gu & Tresp, supplement Eq. 1), without autograd (chapter 4).

    ``grad_v = dL/dv`` at the routing output. The first term is the gradient with the
    final couplings held constant, ``c_im^(K) (dv_m/ds_m)^T dL/dv_m``; the second is
    everything that reaches ``u_hat`` because the couplings depend on it: the
    softmax derivative (their Eq. 3) and the agreement updates of every earlier
    iteration, unrolled by hand back to ``b = 0``.

    Args:
        u_hat: votes ``(B, I, J, D)``.
        grad_v: ``(B, J, D)``.
        iterations: ``K >= 1``; ``K = 1`` has uniform couplings and no second term.
        logit_scale: ``lambda`` of :func:`scaled_routing`.

    Returns:
        ``(direct, through_couplings)``, each ``(B, I, J, D)``; their sum is the full
        gradient and ``direct`` is the gradient of detached routing.
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
    gs = squash_vjp(ss[K], gv)                                # (dv/ds)^T dL/dv, (B, J, D)
    direct = cs[K].unsqueeze(-1) * gs.unsqueeze(1)            # Eq. 1, first term
    through = torch.zeros_like(u)
    gc = torch.einsum("bjd,bijd->bij", gs, u)                 # dL/dc_ij = gs_j . u_hat_{j|i}
    gb = lam * _softmax_vjp(cs[K], gc)                        # Eq. 3: through the softmax
    for t in range(K - 1, -1, -1):
        # b^(t+1) = b^(t) + u_hat . v^(t): the logits' gradient reaches u_hat and v^(t)
        through += gb.unsqueeze(-1) * vs[t].unsqueeze(1)
        gvt = torch.einsum("bij,bijd->bjd", gb, u)
        gst = squash_vjp(ss[t], gvt)
        through += cs[t].unsqueeze(-1) * gst.unsqueeze(1)     # s^(t) = sum_i c^(t) u_hat
        gct = torch.einsum("bjd,bijd->bij", gst, u)
        gb = gb + lam * _softmax_vjp(cs[t], gct)              # b^(t) feeds the next logits and c^(t)
    return direct, through


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


def per_vote_comparison(u_hat: torch.Tensor, grad_v: torch.Tensor, iterations: int = 3,
                        logit_scale: float = 1.0) -> dict:
    """Per vote ``(b, i, m)``: the coupling ``c_im``, ``||second|| / ||full||`` and the cosine
    between the full and the detached gradient (Gu & Tresp Eq. 4-5; chapter 4).

    Returns a dict of flat tensors ``c``, ``ratio``, ``cosine`` of length ``B * I * J``.
    """
    direct, through = gradient_terms(u_hat, grad_v, iterations, logit_scale)
    _, c = scaled_routing(u_hat.detach(), iterations, logit_scale)
    full = direct + through
    fn = full.norm(dim=-1)
    ratio = through.norm(dim=-1) / fn.clamp_min(1e-30)
    cos = (full * direct).sum(-1) / (fn * direct.norm(dim=-1)).clamp_min(1e-30)
    return {"c": c.flatten(), "ratio": ratio.flatten(), "cosine": cos.flatten()}


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


def relative_low(J: int, factor: float = 0.1) -> float:
    """The "decided against" threshold ``factor / J``: a tenth of the uniform coupling ``1/J``
    by default (chapter 4). A fixed 0.1 would be the uniform value itself when ``J = 10``."""
    check_positive_int("J", J)
    if not 0 < factor < 1:
        raise ValueError(f"factor must lie in (0, 1); got {factor}")
    return factor / J


# ----------------------------------------------------------------------------- upstream gradient, per-vote gains

def margin_upstream(u_hat: torch.Tensor, y: torch.Tensor, iterations: int = 3, logit_scale: float = 1.0,
                    vote_scale: float = 1.0):
    """Votes ``alpha * u_hat`` and the margin loss's ``dL/dv`` *for that routing* (chapter 4).

    The polarization knobs change the routing output ``v``, hence the loss and its gradient
    ``dL/dv``: a study over ``lambda`` (``logit_scale``) or ``alpha`` (``vote_scale``) must
    recompute it at every setting rather than reuse the one of ``lambda = alpha = 1``.

    Returns:
        ``(votes (B, I, J, D), grad_v (B, J, D))``, both detached.
    """
    from .ops import margin_loss

    _check_votes(u_hat)
    check_positive_int("iterations", iterations)
    _check_scale(logit_scale)
    _check_scale(vote_scale)
    if y.dim() != 1 or y.shape[0] != u_hat.shape[0]:
        raise ValueError(f"y must be (B,) = ({u_hat.shape[0]},) labels; got {tuple(y.shape)}")
    votes = float(vote_scale) * u_hat.detach()
    with torch.no_grad():
        v, _ = scaled_routing(votes, iterations, logit_scale)
    v = v.requires_grad_(True)
    with torch.enable_grad():
        (gv,) = torch.autograd.grad(margin_loss(v.norm(dim=-1), y), v)
    return votes, gv.detach()


def vote_gains(u_hat: torch.Tensor, grad_v: torch.Tensor, iterations: int = 3, logit_scale: float = 1.0) -> dict:
    """How the full gradient of each vote relates to its detached one (Gu & Tresp Eq. 5; chapter 4).

    Eq. 5 writes the full gradient as ``C`` times the detached one. Per vote ``(b, i, m)`` with
    a non-zero detached (direct) term this returns ``gain = (full . direct) / ||direct||^2``
    (the ``C`` that vote would need), ``norm_ratio = ||full|| / ||direct||`` and the ``cosine``;
    plus ``c`` (its coupling) and ``has_direct`` (a bool mask over all ``B * I * J`` votes; the
    other tensors hold only the votes where it is True, in the same flat order).
    """
    direct, through = gradient_terms(u_hat, grad_v, iterations, logit_scale)
    _, c = scaled_routing(u_hat.detach(), iterations, logit_scale)
    full = (direct + through).flatten(0, 2)
    d = direct.flatten(0, 2)
    dn = d.norm(dim=-1)
    has = dn > 0
    full, d, dn = full[has], d[has], dn[has]
    fn = full.norm(dim=-1)
    return {"has_direct": has, "c": c.flatten()[has], "gain": (full * d).sum(-1) / dn ** 2,
            "norm_ratio": fn / dn, "cosine": (full * d).sum(-1) / (fn * dn).clamp_min(1e-300)}


# ----------------------------------------------------------------------------- on a model

def _default_loss(recon_weight: float):
    from .models import capsnet_loss

    def loss_fn(model, x, y):
        out = model(x, y)
        return capsnet_loss(out, x, y, recon_weight), out.lengths
    return loss_fn


def digit_gradients(model, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None = None,
                    recon_weight: float = 0.0005) -> dict:
    """Gradients of the loss for the DigitCaps weights ``W (I, J, D_out, D_in)`` with full and
    with detached routing, on the same batch (chapter 4).

    ``model`` is a :class:`capslib.models.CapsNet` (anything with ``model.digit.W`` and
    ``model.digit.detach``); its ``detach`` flag is restored and its ``.grad`` fields are
    left untouched. Returns ``full``, ``detached`` (tensors like ``W``), ``rel_diff``
    ``= ||g_full - g_det|| / ||g_full||``, ``cosine``, ``couplings`` (``(B, I, J)``).
    """
    digit = getattr(model, "digit", None)
    if digit is None or not hasattr(digit, "W") or not hasattr(digit, "detach"):
        raise TypeError("model must have a DenseCaps `digit` with attributes `W` and `detach` (a CapsNet)")
    loss_fn = loss_fn or _default_loss(recon_weight)
    was, was_training = digit.detach, model.training
    grads, couplings = {}, None
    try:
        model.eval()
        for name, flag in (("full", False), ("detached", True)):
            digit.detach = flag
            with torch.enable_grad():
                if couplings is None:
                    out = model(x, y)
                    couplings = out.couplings.detach()
                loss, _ = loss_fn(model, x, y)
                (g,) = torch.autograd.grad(loss, digit.W)
            grads[name] = g.detach().double()
    finally:
        digit.detach = was
        model.train(was_training)
    gf, gd = grads["full"], grads["detached"]
    rel = float((gf - gd).norm() / gf.norm().clamp_min(1e-30))
    cos = float((gf * gd).sum() / (gf.norm() * gd.norm()).clamp_min(1e-30))
    return {"full": gf, "detached": gd, "rel_diff": rel, "cosine": cos, "couplings": couplings}


def step_cost(model, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None = None, pairs: int = 15,
              warmup: int = 2, recon_weight: float = 0.0005) -> dict:
    """The cost of one training step (forward and backward of the loss) of ``model`` with full and
    with detached routing, on the same batch and the same weights (chapter 4).

    Wall time: ``pairs`` interleaved pairs of steps, the order inside a pair alternating, after
    ``warmup`` pairs that are not kept (:func:`capslib.timing.interleaved_seconds`). A neighbour that slows the machine for a while slows both
    members of a pair alike, so the per-pair ratio full / detached keeps the method's difference
    where the epoch times of separate runs mix it with the machine's load. Work: the floating-point
    operations of each step counted by ``torch.utils.flop_counter`` (matrix products and
    convolutions only; elementwise work is not counted), which no load can change.

    Returns ``seconds`` ({"full", "detached"}: per-pair lists), ``ratio`` (per-pair full /
    detached), ``flops`` ({"full", "detached"}: per step). The model's ``detach`` flag, training
    mode and ``.grad`` fields are left as they were.
    """
    from torch.utils.flop_counter import FlopCounterMode

    digit = getattr(model, "digit", None)
    if digit is None or not hasattr(digit, "detach"):
        raise TypeError("model must have a DenseCaps `digit` with a `detach` flag (a CapsNet)")
    if not (isinstance(pairs, int) and pairs >= 2) or not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"pairs must be an int >= 2 and warmup an int >= 0; got {pairs!r}, {warmup!r}")
    from .timing import interleaved_seconds

    loss_fn = loss_fn or _default_loss(recon_weight)
    params = [p for p in model.parameters() if p.requires_grad]
    was, was_training = digit.detach, model.training

    def step(flag: bool):
        def run():
            digit.detach = flag
            with torch.enable_grad():
                loss, _ = loss_fn(model, x, y)
                torch.autograd.grad(loss, params)
        return run

    flops = {}
    try:
        model.train()
        seconds = interleaved_seconds({"full": step(False), "detached": step(True)}, rounds=pairs, warmup=warmup,
                                      device=x.device if x.is_cuda else None)
        for name, flag in (("full", False), ("detached", True)):
            with FlopCounterMode(display=False) as counter:
                step(flag)()
            flops[name] = counter.get_total_flops()
    finally:
        digit.detach = was
        model.train(was_training)
    ratio = [f / d for f, d in zip(seconds["full"], seconds["detached"])]
    return {"seconds": seconds, "ratio": ratio, "flops": flops}


class CouplingProbe:
    """Measures, on a fixed probe batch, the relative gradient difference of the DigitCaps
    weights and the coupling polarization while :func:`capslib.train.fit` trains (chapter 4).

    Pass ``before_step=probe.before_step`` and ``on_epoch_end=probe.on_epoch_end``.
    Every ``every`` steps (and at step 0) it records ``step``, ``rel_diff``, ``cosine``,
    ``entropy``, ``frac_high`` (``c > 0.9``), ``frac_low`` (``c <`` :func:`relative_low`, a tenth
    of the uniform ``1/J``); the measurement at each epoch end also closes the trace,
    so its last point is the network after the last step. At each epoch end it appends one entry to
    ``by_epoch`` (the first entry, epoch 0, is the untrained network; call :meth:`start`
    first). The time its step-wise measurements take inside each epoch is kept in
    ``seconds_by_epoch``, so that training time can be told apart from probing time.
    At each epoch end all three are also copied into ``fit``'s history (keys
    ``coupling_trace``, ``coupling_by_epoch``, ``probe_seconds``), which the checkpoint keeps.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, every: int = 16, recon_weight: float = 0.0005):
        check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
        check_positive_int("every", every)
        self.x, self.y, self.every, self.recon_weight = x, y, every, recon_weight
        self.step = 0
        self.trace = {k: [] for k in ("step", "rel_diff", "cosine", "entropy", "frac_high", "frac_low")}
        self.by_epoch = {k: [] for k in ("epoch", "rel_diff", "cosine", "entropy", "frac_high", "frac_low")}
        self.seconds_by_epoch: list[float] = []
        self._secs = 0.0

    def measure(self, model) -> dict:
        g = digit_gradients(model, self.x, self.y, recon_weight=self.recon_weight)
        c = g["couplings"]
        # thresholds relative to the uniform coupling 1/J (with J = 10, "c < 0.1" would be the uniform value)
        p = polarization(c, high=0.9, low=relative_low(c.shape[-1]))
        return {"rel_diff": g["rel_diff"], "cosine": g["cosine"], "entropy": p["entropy"],
                "frac_high": p["frac_high"], "frac_low": p["frac_low"]}

    def _log(self, model, where: dict, key) -> dict:
        t0 = time.perf_counter()
        m = self.measure(model)
        where[key].append(self.step if key == "step" else len(where[key]))
        for k, val in m.items():
            where[k].append(val)
        self._secs += time.perf_counter() - t0
        return m

    def _traced(self) -> bool:
        return bool(self.trace["step"]) and self.trace["step"][-1] == self.step

    def before_step(self, model, optimizer) -> None:
        if self.step % self.every == 0 and not self._traced():
            self._log(model, self.trace, "step")
        self.step += 1

    def on_epoch_end(self, epoch, model, history) -> None:
        if not self.by_epoch["epoch"]:
            raise RuntimeError("call probe.start(model) before training so that epoch 0 is recorded")
        self.seconds_by_epoch.append(self._secs)  # probe time inside fit's timed loop
        m = self._log(model, self.by_epoch, "epoch")
        self._secs = 0.0
        if not self._traced():  # the same measurement closes the step trace (its last point is the trained net)
            self.trace["step"].append(self.step)
            for k, val in m.items():
                self.trace[k].append(val)
        # kept in fit's history, so that a run resumed from its checkpoint still has them
        history["coupling_trace"] = {k: list(v) for k, v in self.trace.items()}
        history["coupling_by_epoch"] = {k: list(v) for k, v in self.by_epoch.items()}
        history["probe_seconds"] = list(self.seconds_by_epoch)

    def start(self, model) -> None:
        """Record epoch 0 (the network before any step)."""
        self._log(model, self.by_epoch, "epoch")
        self._secs = 0.0


# ----------------------------------------------------------------------------- autograd graphs

def _short(fn) -> str:
    name = type(fn).__name__
    for tail in ("Backward0", "Backward1", "Backward"):
        if name.endswith(tail):
            return name[: -len(tail)]
    return name


# ops that only move or copy memory; `simplify=True` contracts them away
SHAPE_OPS = frozenset({"View", "UnsafeView", "Permute", "Clone", "Unsqueeze", "Squeeze", "Expand", "Reshape",
                       "Transpose", "T", "Alias"})


def autograd_graph(output: torch.Tensor, inputs: dict | None = None, output_name: str = "v",
                   simplify: bool = True):
    """The backward graph of ``output`` as a :class:`networkx.DiGraph`, drawn forward (chapter 4;
    Gu & Tresp Appx. C, Fig. 2-3).

    Walks ``output.grad_fn`` and ``next_functions``. Nodes are autograd functions
    (attribute ``label``: the op name without ``Backward0``; ``kind``: ``"op"``,
    ``"input"`` for a leaf named in ``inputs``, ``"leaf"`` otherwise, ``"output"``).
    An edge ``a -> b`` means ``a``'s result feeds ``b`` in the forward pass, so a
    gradient flows from ``b`` back to ``a``.

    Args:
        output: a tensor with a ``grad_fn``.
        inputs: ``{name: leaf tensor}`` to label the leaves (e.g. ``{"û": u_hat}``).
        simplify: contract the memory-only ops of :data:`SHAPE_OPS` (views, permutes,
            clones that ``einsum`` adds): every path between the remaining nodes is kept.
    """
    import networkx as nx

    check_tensor("output", output)
    if output.grad_fn is None:
        raise ValueError("output has no grad_fn: compute it from tensors that require grad")
    named = list((inputs or {}).items())

    def name_of(var):  # a leaf named in `inputs`: the same tensor (same storage, shape and strides)
        for n, t in named:
            if var is t or (var.data_ptr() == t.data_ptr() and var.shape == t.shape and var.stride() == t.stride()):
                return n
        return None

    # Every function object visited is kept alive until the walk ends: node keys are id()s, and a
    # torch build that hands out a fresh wrapper per access would otherwise reuse the id of a
    # collected one (a false cycle).
    alive = []
    G = nx.DiGraph()
    out_node = ("output", output_name)
    G.add_node(out_node, label=output_name, kind="output")
    seen, stack = set(), [output.grad_fn]
    G.add_edge(id(output.grad_fn), out_node)
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        alive.append(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            name = name_of(var)
            G.add_node(id(fn), label=name or "leaf", kind="leaf" if name is None else "input")
        else:
            G.add_node(id(fn), label=_short(fn), kind="op")
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                alive.append(nxt)
                G.add_edge(id(nxt), id(fn))
                stack.append(nxt)
    if simplify:
        for n in [n for n, d in G.nodes(data=True) if d["kind"] == "op" and d["label"] in SHAPE_OPS]:
            G.add_edges_from((a, b) for a in G.predecessors(n) for b in G.successors(n))
            G.remove_node(n)
    return G


def nodes_labelled(G, text: str) -> list:
    """Nodes of ``G`` whose label contains ``text``."""
    return [n for n, d in G.nodes(data=True) if text in d["label"]]


def coupling_paths(G, source: str = "û", via: str = "Softmax") -> int:
    """How many ``via`` nodes (the softmax that makes ``c``) lie on a forward path from the
    input labelled ``source``: 0 means no gradient can flow from ``c`` back to ``û`` (chapter 4)."""
    import networkx as nx

    srcs = nodes_labelled(G, source)
    if not srcs:
        raise ValueError(f"no node labelled {source!r} in the graph")
    return sum(1 for n in nodes_labelled(G, via) if any(nx.has_path(G, s, n) for s in srcs))


_COLORS = {"input": "#4c9f70", "output": "#c0392b", "leaf": "#95a5a6", "softmax": "#e67e22", "op": "#aed6f1"}


def draw_graph(G, ax=None, title: str | None = None, font_size: float = 9):
    """Draw :func:`autograd_graph`'s graph top to bottom in topological layers (chapter 4).

    Positions come from :func:`networkx.multipartite_layout` over the graph's
    topological generations, one row per generation; softmax nodes (where the couplings are
    made) are orange. Without ``ax`` the figure is 6 inches wide (inside the book's text column,
    so the 9-pt labels stay legible there) and grows in height with the number of generations.
    Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt
    import networkx as nx

    for layer, nodes in enumerate(nx.topological_generations(G)):
        for n in nodes:
            G.nodes[n]["layer"] = layer
    pos = {n: (x, -y) for n, (x, y) in
           nx.multipartite_layout(G, subset_key="layer", align="horizontal").items()}   # first generation on top
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.0, max(4.0, 0.5 * (layer + 1))))
    else:
        fig = ax.figure

    def color(d):
        return _COLORS["softmax"] if "Softmax" in d["label"] else _COLORS[d["kind"]]

    near = [(a, b) for a, b in G.edges if G.nodes[b]["layer"] - G.nodes[a]["layer"] == 1]
    far = [(a, b) for a, b in G.edges if G.nodes[b]["layer"] - G.nodes[a]["layer"] > 1]
    nx.draw_networkx_edges(G, pos, edgelist=near, ax=ax, arrows=True, arrowsize=7, width=0.7,
                           edge_color="#555555", node_size=420)
    # edges that skip layers are drawn as arcs so that they do not hide behind the chain
    nx.draw_networkx_edges(G, pos, edgelist=far, ax=ax, arrows=True, arrowsize=7, width=0.7,
                           edge_color="#2e86c1", node_size=420, connectionstyle="arc3,rad=-0.25")
    nx.draw_networkx_nodes(G, pos, ax=ax, node_size=420, node_color=[color(d) for _, d in G.nodes(data=True)],
                           edgecolors="#333333", linewidths=0.5)
    nx.draw_networkx_labels(G, pos, labels={n: d["label"] for n, d in G.nodes(data=True)}, ax=ax,
                            font_size=font_size)
    ax.margins(x=0.15)   # room for the outer nodes' labels
    ax.set_axis_off()
    if title:
        ax.set_title(title)
    return fig


# ----------------------------------------------------------------------------- semantic graphs (Appx. C)

def routing_trace(u_hat: torch.Tensor, iterations: int = 3, detach: bool = False):
    """Dynamic routing that keeps each iteration's tensors under their names (chapter 4).

    The same computation as :func:`scaled_routing` at ``logit_scale = 1`` (and so as
    :func:`capslib.dynamic_routing`): ``B(t)``, ``c(t)``, ``s(t)``, ``v(t)`` for ``t = 1..K``,
    with ``B(1) = 0``. :func:`semantic_graph` reads which of them autograd connects.

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


def semantic_graph(named: dict, inputs: dict):
    """Which named tensors feed which, read from autograd (chapter 4; Gu & Tresp Appx. C).

    For every tensor in ``named`` that has a ``grad_fn``, walk ``next_functions`` backwards
    until another named tensor's ``grad_fn`` or a leaf named in ``inputs`` is reached: that gives
    an edge ``source -> tensor`` (a gradient can flow from the tensor back to the source).
    A named tensor without ``grad_fn`` is a constant to autograd (attribute ``kind="constant"``):
    no gradient reaches anything through it. Returns a :class:`networkx.DiGraph` with node
    attribute ``kind`` (``"input"``, ``"tensor"``, ``"constant"``).
    """
    import networkx as nx

    if not named:
        raise ValueError("named must hold at least one tensor")
    G = nx.DiGraph()
    alive, owner = [], {}
    for name, t in named.items():
        check_tensor(name, t)
        if t.grad_fn is not None:
            alive.append(t.grad_fn)
            owner[id(t.grad_fn)] = name
            G.add_node(name, kind="tensor")
        else:
            G.add_node(name, kind="constant")
    leaves = list(inputs.items())
    for name in inputs:
        G.add_node(name, kind="input")
    for name, t in named.items():
        if t.grad_fn is None:
            continue
        seen, stack = set(), [nxt for nxt, _ in t.grad_fn.next_functions if nxt is not None]
        while stack:
            fn = stack.pop()
            alive.append(fn)
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            if id(fn) in owner:
                G.add_edge(owner[id(fn)], name)
                continue
            var = getattr(fn, "variable", None)
            if var is not None:
                for leaf_name, leaf in leaves:
                    if var is leaf:
                        G.add_edge(leaf_name, name)
                continue
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return G


def coupling_gradient_edges(G, source: str = "û") -> list:
    """Edges of :func:`semantic_graph`'s graph that lie on a path ``source -> c(t) -> ...``: the
    road by which a gradient reaches the votes *through the couplings* (chapter 4)."""
    import networkx as nx

    on = set()
    for c in (n for n in G if n.startswith("c(")):
        if G.nodes[c]["kind"] == "constant" or not nx.has_path(G, source, c):
            continue
        up = nx.ancestors(G, c) | {c}
        down = nx.descendants(G, c) | {c}
        on |= {(a, b) for a, b in G.edges if (a in up and b in up) or (a in down and b in down)}
    return sorted(on)


def draw_semantic_graph(G, ax=None, title: str | None = None):
    """Draw :func:`semantic_graph`'s graph of routing: one column per iteration (rows B, c, s, v),
    the votes û drawn once in front of every column that reads them (the same tensor each time),
    so that no edge crosses a column (chapter 4). Edges on a gradient road through the couplings
    are orange; constants are drawn hollow with a dashed rim. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt
    import networkx as nx

    rows = {"B": 3, "c": 2, "s": 1, "v": 0}
    step = 1.6

    def column(n):
        return int(n[2:-1]) if n[0] in rows and n[1:2] == "(" else None

    hot = set(coupling_gradient_edges(G)) if any(d["kind"] == "input" for _, d in G.nodes(data=True)) else set()
    H, pos, hot_H = nx.DiGraph(), {}, set()
    for n, d in G.nodes(data=True):
        if d["kind"] != "input":
            H.add_node(n, **d)
            pos[n] = (step * column(n), rows[n[0]])
    inputs = [n for n, d in G.nodes(data=True) if d["kind"] == "input"]
    for a, b in G.edges:
        if a in inputs:  # one copy of the input per column it feeds, just left of that column
            t = column(b)
            copy = f"{a} ({t})"
            H.add_node(copy, kind="input", label=a)
            pos[copy] = (step * t - 0.55 * step, 2.5)   # between the logit and coupling rows: clear of v -> B
            H.add_edge(copy, b)
            if (a, b) in hot:
                hot_H.add((copy, b))
        else:
            H.add_edge(a, b)
            if (a, b) in hot:
                hot_H.add((a, b))
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.0, 3.6))   # the book's text column
    else:
        fig = ax.figure
    for color, group in (("#e67e22", [e for e in H.edges if e in hot_H]), ("#7f8c8d", [e for e in H.edges if e not in hot_H])):
        if group:
            nx.draw_networkx_edges(H, pos, edgelist=group, ax=ax, arrows=True, arrowsize=11, width=1.3,
                                   edge_color=color, node_size=800)
    colors = {"input": "#4c9f70", "tensor": "#aed6f1", "constant": "white"}
    for kind, style in (("input", "solid"), ("tensor", "solid"), ("constant", "dashed")):
        nodes = [n for n, d in H.nodes(data=True) if d["kind"] == kind]
        if nodes:
            coll = nx.draw_networkx_nodes(H, pos, nodelist=nodes, ax=ax, node_size=800 if kind != "input" else 500,
                                          node_color=colors[kind], edgecolors="#333333", linewidths=1.0)
            coll.set_linestyle(style)
    nx.draw_networkx_labels(H, pos, labels={n: d.get("label", n) for n, d in H.nodes(data=True)}, ax=ax, font_size=10)
    ax.set_axis_off()
    xs = [x for x, _ in pos.values()]
    ax.set(xlim=(step * 0.45 - 0.4, max(xs) + 0.4), ylim=(-0.45, 3.45))   # the same frame with or without û
    if title:
        ax.set_title(title, fontsize=10)
    return fig
