"""Chapter 4 (the coupling-gradient proof): its sizes per profile
(``capslib.book.profiles.settings("04_coupling_gradient_proof")``), the measurements it takes on a
training CapsNet (:func:`digit_gradients`, :class:`CouplingProbe`, :func:`step_cost`) and its graphs
of what autograd connects (:func:`autograd_graph`, :func:`semantic_graph` and their drawings).

The chapter's mathematics, the two gradient terms and the polarization of the couplings, is the
library's :mod:`capslib.coupling_gradient`.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch

from . import profiles
from .units import built_in_float64, cuda_speed_settings, seed_spread, step_summary
from ..checks import check_positive_int, check_tensor
from ..coupling_gradient import _check_scale, _check_votes, polarization, scaled_routing

CHAPTER = "04_coupling_gradient_proof"

# Sizes of chapter 4's experiments. `full` is Table 1 of Gu & Tresp's supplement (its
# numbers are the gu_* keys of book/paper_results.yml; the chapter asserts that they agree)
# on the network of Sabour et al. (their Fig. 1). One pair of runs (full gradient and
# detached couplings) trains on 28x28 digits (`train_subset` of the training split), a
# second pair (`expanded_*`) on expanded MNIST (40x40, shifted up to 6 px) for the
# affNIST-style test. Both pairs are trained from `seeds` seeds (sess.seed + k), the
# same seed for both variants, so that their difference can be taken seed by seed. A third
# variant, uniform routing (one iteration, c = 1/J: Gu & Tresp's proposal to drop routing),
# trains beside them from the same seeds. `ci` shrinks the networks and the data so that three
# seeds fit the time budget; its expanded runs take small batches (`expanded_batch_size`, with
# `expanded_lr`) so that they reach a train accuracy above 0.9 in `expanded_epochs` epochs
# (with batches of 64 they stopped near 0.5-0.75). `margin`: the margin of practical equivalence of
# two variants' test accuracies, declared before the runs (capslib.book.stats.Equivalence): one point
# of accuracy at `ci`, where networks reach about 0.9; 0.2 points at `full`, the size of Table 1's gaps.
# `world_*`: the small world of part capsules whose agreement decides the whole (part_whole_world),
# the same at both profiles (seconds on a CPU): parts, wholes, pose dimension, pose noise SD, pose
# length, training and test examples, the shorter of its two training lengths (the other is twice
# it) and Adam's learning rate.
profiles.register(
    CHAPTER,
    ci=dict(dataset="embedded", image_size=28, conv_channels=32, primary_types=4, primary_dim=8, digit_dim=16,
            decoder=(128, 256), iterations=3, epochs=3, batch_size=64, lr=2e-3, recon_weight=0.0005,
            train_subset=2200, seeds=3, probe_size=64, probe_every=16, cost_pairs=20, margin=0.01,
            world_parts=8, world_wholes=4, world_dim=4, world_noise=1.0, world_scale=5.0,
            world_train=1000, world_test=1000, world_epochs=5, world_lr=0.01,
            expanded_subset=1200, expanded_epochs=4, expanded_conv_channels=16, expanded_primary_types=4,
            expanded_primary_stride=3, expanded_batch_size=16, expanded_lr=4e-3),
    full=dict(dataset="mnist", image_size=28, conv_channels=256, primary_types=32, primary_dim=8, digit_dim=16,
              decoder=(512, 1024), iterations=3, epochs=10, batch_size=128, lr=1e-3, recon_weight=0.0005,
              train_subset=None, seeds=3, probe_size=500, probe_every=100, cost_pairs=20, margin=0.002,
              world_parts=8, world_wholes=4, world_dim=4, world_noise=1.0, world_scale=5.0,
              world_train=1000, world_test=1000, world_epochs=5, world_lr=0.01,
              expanded_subset=None, expanded_epochs=5, expanded_conv_channels=256, expanded_primary_types=32,
              expanded_primary_stride=2, expanded_batch_size=128, expanded_lr=1e-3),
    # `full` is cut to fit one H100 in minutes: the chapter took about 7 (28x28 epochs 3.5 s with the
    # full gradient, 3.0 s detached; docs/gpu.md, "GPU use"); CAPSBOOK_PAPER_SCHEDULE=1 restores Table 1's
    # 100 epochs (and five seeds; capslib.tools.bench projects about 53 minutes of training on one H100).
    paper=dict(epochs=100, seeds=5, expanded_epochs=100),
)


# ----------------------------------------------------------------------------- on a model

def _default_loss(recon_weight: float):
    from ..models import capsnet_loss

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
    ``warmup`` pairs that are not kept (:func:`capslib.book.timing.interleaved_seconds`). A neighbour that slows the machine for a while slows both
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
    ``entropy``, ``frac_high`` (``c > 0.9``), ``frac_low`` (``c <``
    :func:`relative_low`, a tenth of the uniform ``1/J``); the
    measurement at each epoch end also closes the trace, so its last point is the network after
    the last step. At each epoch end it appends one entry to
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

def semantic_graph(named: dict, inputs: dict):
    """Which named tensors feed which, read from autograd (chapter 4; Gu & Tresp Appx. C); ``named``
    as :func:`capslib.coupling_gradient.routing_trace` returns it.

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


# ============================================================================= paper scale as experiment units
#
# Every training that chapter 4's paper-scale claims rest on, one unit per configuration and seed
# (see :mod:`capslib.book.units`):
#
# - ``04/mnist/<variant>/s<k>``: Sabour et al.'s CapsNet (with its decoder) trained on all 55,000
#   training digits for Table 1's 100 epochs (batch 128, Adam 1e-3, 3 iterations, reconstruction
#   weight 0.0005), with full-gradient routing, detached couplings, or uniform routing (one
#   iteration, c = 1/J). Measured: test accuracy; after every epoch, on a fixed batch of validation
#   digits, the relative difference and cosine of the full and detached gradients of W and the
#   couplings' row entropy and polarisation (the chapter's CouplingProbe, at epoch ends only); on the
#   trained weights and the test digits, the accuracy with routing replaced by uniform couplings
#   (K = 1) beside the accuracy with three iterations, ||v^(3) - v^(1)|| / ||v^(1)||, the couplings'
#   row entropy against ln J, and the second term's share of the votes' gradient on the probe batch.
# - ``04/expanded/<variant>/s<k>``: the same three variants on expanded MNIST (40x40, shifted up to
#   6 px), tested on the centred 40x40 test digits and on the affNIST-style ones. 50 epochs instead of
#   Table 1's 100: a 40x40 CapsNet trains at half the rate, and 100 epochs would not fit one unit.

UNIT_SEEDS = tuple(range(5))          # Table 1's five runs
UNIT_VARIANTS = {"full": (False, 3), "detached": (True, 3), "uniform": (False, 1)}   # name -> (detach, iterations)
VARIANT_LABELS = {"full": "full gradient", "detached": "detached couplings", "uniform": "uniform routing"}
# ``version`` counts changes to what the units' ``run`` or ``capslib.train.fit`` do that the probe
# cannot see (bump it with such a change: every chapter-4 result then reads stale).
UNIT_SCHEDULE = dict(version=1, dataset="mnist", split_seed=0, validation=5000, train_images=55_000, epochs=100,
                     batch_size=128, lr=1e-3, lr_decay=None, recon_weight=0.0005, iterations=3, probe_digits=500,
                     probe_seed=1, eval_batch=1000, second_term_digits=100, optimizer="Adam",
                     precision="float32 weights and activations, TF32 products and convolutions",
                     step="fit's fast path: whole batches only (the last partial batch of each epoch dropped), "
                          "fused Adam, the step captured in a CUDA graph where the capture works")
UNIT_EXPANDED = dict(epochs=50, size=40, max_shift=6, expand_seed=0, affine_seed=0, primary_stride=2)
UNIT_CAPSNET = dict(conv_channels=256, primary_types=32, primary_dim=8, digit_dim=16, decoder=[512, 1024])
PAPER_EPOCHS = 100                    # Table 1 (paper_results.yml: gu_epochs; checked in the chapter)
UNIT_SMOKE = dict(dataset="embedded", epochs=1, batch_size=32, train=256, val=100, test=200, probe_digits=32,
                  second_term_digits=8,
                  capsnet=dict(conv_channels=8, primary_types=2, primary_dim=8, digit_dim=16, decoder=[32, 64]))


def unit_build(unit, smoke: bool = False):
    """The unit's untrained CapsNet (weights drawn after ``torch.manual_seed(unit.seed)``, as the chapter)."""
    from ..models import CapsNet

    cfg = unit.config
    sizes = UNIT_SMOKE["capsnet"] if smoke else cfg["capsnet"]
    detach, iterations = UNIT_VARIANTS[cfg["variant"]]
    return CapsNet(image_size=cfg["image_size"], conv_channels=sizes["conv_channels"],
                   primary_types=sizes["primary_types"], primary_dim=sizes["primary_dim"],
                   primary_stride=cfg["primary_stride"], digit_dim=sizes["digit_dim"],
                   decoder=tuple(sizes["decoder"]), iterations=iterations, detach=detach)


def unit_loss(recon_weight: float):
    from ..models import capsnet_loss

    def loss_fn(model, x, y):
        out = model(x, y)
        return capsnet_loss(out, x, y, recon_weight), out.lengths
    return loss_fn


def unit_probe(unit) -> dict:
    """One training step of the unit's network at full size in float64 on the CPU (weights drawn from
    seed 0, four seeded random images of the unit's size, its routing and loss): loss and per-parameter
    gradient norms."""
    torch.manual_seed(0)
    net = built_in_float64(lambda: unit_build(unit, smoke=False))
    size = unit.config["image_size"]
    x = torch.rand(4, 1, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = torch.tensor([0, 3, 7, 9])
    loss, _ = unit_loss(unit.config["recon_weight"])(net, x, y)
    loss.backward()
    return step_summary(loss, x, net)


def _unit_data(unit, device, smoke: bool):
    """Training digits, validation digits, the probe batch and the named test sets, on ``device``."""
    from .. import data

    cfg = unit.config
    splits = data.load(UNIT_SMOKE["dataset"] if smoke else cfg["dataset"], seed=cfg["split_seed"])
    tr, val, te = splits["train"], splits["val"], splits["test"]
    if smoke:
        tr, val, te = tr.subset(UNIT_SMOKE["train"], seed=unit.seed), val.subset(UNIT_SMOKE["val"]), te.subset(UNIT_SMOKE["test"])
    elif (len(tr), len(val)) != (cfg["train_images"], cfg["validation"]):
        raise ValueError(f"{unit.key}: expected {cfg['train_images']:,} training and {cfg['validation']:,} validation "
                         f"digits; got {len(tr):,} and {len(val):,} (a smoke setting in the environment?)")
    probe = val.subset(UNIT_SMOKE["probe_digits"] if smoke else cfg["probe_digits"], seed=cfg["probe_seed"])
    if cfg["data"] == "expanded":
        size = cfg["image_size"]
        tr = data.Split(data.expand(tr.x, size=size, max_shift=cfg["max_shift"], seed=cfg["expand_seed"]), tr.y)
        val = data.Split(data.pad_to(val.x, size), val.y)
        probe = data.Split(data.pad_to(probe.x, size), probe.y)
        tests = {"centred": data.Split(data.pad_to(te.x, size), te.y),
                 "affine": data.Split(data.affine(te.x, size=size, seed=cfg["affine_seed"]), te.y)}
    else:
        tests = {"test": te}
    move = lambda s: data.Split(s.x.to(device), s.y.to(device))   # noqa: E731
    return move(tr), move(val), move(probe), {k: move(s) for k, s in tests.items()}


ROW_STATES = (("undecided", 0.0, 0.9), ("decided", 0.9, 0.99), ("saturated", 0.99, 1.01))


def second_term_by_row(u_hat: torch.Tensor, y: torch.Tensor, iterations: int, scales) -> dict:
    """Where the second term of a vote's gradient comes from, by how decided the vote's row is.

    For each logit scale ``lambda`` in ``scales``: the margin loss's upstream gradient for that routing,
    the gradient split by iteration (:func:`capslib.coupling_gradient.gradient_by_iteration`), and each
    row ``i`` of each sample classed by its largest last coupling ``max_j c_ij`` (:data:`ROW_STATES`:
    below 0.9, 0.9 to 0.99, above 0.99). Returns ``{lambda: {state: {"rows": share of the rows,
    "second": mean norm of the row's second term (over its J votes), "by_iteration": share of the
    second term's summed norm that flows through each iteration 1..K-1}}}``; a state without rows
    at a scale is left out there."""
    from ..coupling_gradient import gradient_by_iteration

    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
    check_positive_int("iterations", iterations, minimum=2)
    out = {}
    for lam in scales:
        u, gv = margin_upstream(u_hat, y, iterations, float(lam))
        pieces = gradient_by_iteration(u, gv, iterations, float(lam))
        decided = scaled_routing(u, iterations, float(lam))[1].max(dim=2).values          # (B, I)
        second = pieces[:-1].sum(0).norm(dim=-1).norm(dim=2)                            # (B, I)
        per_iter = pieces[:-1].norm(dim=-1).sum(3)                                      # (K-1, B, I)
        at = {}
        for state, lo, hi in ROW_STATES:
            rows = (decided >= lo) & (decided < hi)
            if rows.any():
                flows = per_iter[:, rows].sum(1)
                at[state] = {"rows": float(rows.double().mean()), "second": float(second[rows].mean()),
                             "by_iteration": (flows / flows.sum()).tolist()}
        out[float(lam)] = at
    return out


@torch.no_grad()
def routing_effect(net, split, batch: int = 1000) -> tuple[dict, dict]:
    """What routing does to the forward pass of a trained CapsNet on ``split``: the accuracy with
    three iterations and with uniform couplings (K = 1) on the same votes, ||v^(3) - v^(1)|| / ||v^(1)||
    per digit, and the last couplings' row entropy (nats) and polarisation."""
    from ..routing import dynamic_routing

    net.eval()
    K = max(net.digit.iterations, UNIT_SCHEDULE["iterations"])
    correct = {1: 0, K: 0}
    ratios, ent, hist, pol = [], [], torch.zeros(50, dtype=torch.float64), []
    for i in range(0, len(split), batch):
        x, y = split.x[i:i + batch], split.y[i:i + batch]
        u_hat = net.digit.votes(net.primary_capsules(x)).float()
        v1, _ = dynamic_routing(u_hat, 1)
        vK, c = dynamic_routing(u_hat, K)
        for k, v in ((1, v1), (K, vK)):
            correct[k] += int((v.norm(dim=-1).argmax(1) == y).sum())
        ratios.append(((vK - v1).flatten(1).norm(dim=1) / v1.flatten(1).norm(dim=1).clamp_min(1e-30)).double().cpu())
        ent.append((-(c * c.clamp_min(1e-30).log()).sum(-1)).mean(1).double().cpu())    # per digit
        hist += torch.histc(c.double().cpu(), bins=50, min=0, max=1)
        pol.append(polarization(c, high=0.9, low=relative_low(c.shape[-1])))
    r, e = torch.cat(ratios), torch.cat(ent)
    J = net.digit.out_caps
    n = len(split)
    metrics = {"iterations": K, "accuracy_routed": correct[K] / n, "accuracy_K1": correct[1] / n,
               "accuracy_K1_minus_routed": (correct[1] - correct[K]) / n,
               "v_change_mean": float(r.mean()), "v_change_median": float(r.median()),
               "row_entropy_nats": float(e.mean()), "log_J": math.log(J),
               "row_entropy_over_log_J": float(e.mean()) / math.log(J),
               "frac_high": float(np.mean([p["frac_high"] for p in pol])),
               "frac_low": float(np.mean([p["frac_low"] for p in pol]))}
    from .units import encode_array
    return metrics, {"coupling_hist": encode_array(hist), "v_change_hist": encode_array(
        torch.histc(r.clamp(0, 2), bins=40, min=0, max=2))}


def second_term_share(u_hat: torch.Tensor, y: torch.Tensor, iterations: int = 3) -> float:
    """The second term's share of the votes' gradient (GT1) for votes ``u_hat`` (B, I, J, D) of digits
    labelled ``y``, the gradient arriving at the outputs being the margin loss's; float64."""
    from .. import coupling_gradient as cg
    from ..ops import margin_loss
    from ..routing import dynamic_routing

    u_hat = u_hat.detach().double()
    u = u_hat.clone().requires_grad_(True)
    v, _ = dynamic_routing(u, iterations)
    (gv,) = torch.autograd.grad(margin_loss(v.norm(dim=-1), y), v)
    return cg.second_term_ratio(u_hat, gv, iterations)


def _second_term(net, probe, digits: int) -> dict:
    """The second term's share of the votes' gradient (GT1) on the first ``digits`` probe digits, in
    float64, for routing with three iterations on the trained votes."""
    net.eval()
    with torch.no_grad():
        u_hat = net.digit.votes(net.primary_capsules(probe.x[:digits]))
    return {"ratio": second_term_share(u_hat, probe.y[:digits], UNIT_SCHEDULE["iterations"]),
            "digits": int(min(digits, len(probe)))}


def unit_run(unit, device: torch.device, smoke: bool) -> dict:
    """Train the unit's network (see the notes above the unit declarations) and measure it."""
    import os

    from .. import train

    cfg = unit.config
    cuda_speed_settings(device)
    tr, val, probe, tests = _unit_data(unit, device, smoke)
    epochs = UNIT_SMOKE["epochs"] if smoke else cfg["epochs"]
    torch.manual_seed(unit.seed)
    net = unit_build(unit, smoke).to(device)
    watch = CouplingProbe(probe.x, probe.y, every=10 ** 9, recon_weight=cfg["recon_weight"])
    watch.start(net)
    history = train.fit(net, tr, unit_loss(cfg["recon_weight"]), epochs=epochs,
                        batch_size=UNIT_SMOKE["batch_size"] if smoke else cfg["batch_size"], lr=cfg["lr"],
                        lr_decay=cfg["lr_decay"], val=val, seed=unit.seed, amp=False, progress=True,
                        on_epoch_end=watch.on_epoch_end, eval_batch_size=cfg["eval_batch"], desc=unit.key,
                        fast="static" if os.environ.get("CAPSBOOK_NO_GRAPH", "").strip() not in ("", "0") else True)
    metrics = {"variant": cfg["variant"], "epochs": epochs, "train_images": len(tr), "data": cfg["data"],
               "final_val_accuracy": history["val_acc"][-1], "final_train_accuracy": history["train_acc"][-1],
               "images_per_s_median": float(np.median(history["images_per_s"])),
               "seconds_per_epoch_median": train.seconds_per_epoch(history),
               "step_path": history.get("step_path"), "step_path_reason": history.get("step_path_reason")}
    arrays = {}
    for name, split in tests.items():
        metrics[f"{name}_accuracy"] = train.evaluate(net, split, batch_size=cfg["eval_batch"])
        metrics[f"{name}_images"] = len(split)
        m, a = routing_effect(net, split, cfg["eval_batch"])
        metrics[f"{name}_routing"] = m
        arrays.update({f"{name}_{k}": v for k, v in a.items()})
    metrics["second_term"] = _second_term(net, probe, UNIT_SMOKE["second_term_digits"] if smoke
                                          else cfg["second_term_digits"])
    hist = {k: v for k, v in history.items() if isinstance(v, list)}
    hist["coupling_by_epoch"] = {k: list(v) for k, v in watch.by_epoch.items()}
    return {"metrics": metrics, "history": hist, "arrays": arrays}


def _unit_config(data_kind: str, variant: str) -> dict:
    cfg = {**UNIT_SCHEDULE, "data": data_kind, "variant": variant, "capsnet": UNIT_CAPSNET, "image_size": 28,
           "primary_stride": 2}
    if data_kind == "expanded":
        cfg.update(epochs=UNIT_EXPANDED["epochs"], image_size=UNIT_EXPANDED["size"],
                   max_shift=UNIT_EXPANDED["max_shift"], expand_seed=UNIT_EXPANDED["expand_seed"],
                   affine_seed=UNIT_EXPANDED["affine_seed"], primary_stride=UNIT_EXPANDED["primary_stride"])
    return cfg


def _register_units() -> None:
    from .units import Unit, register

    for s in UNIT_SEEDS:
        for i, (data_kind, family) in enumerate((("mnist", "capsnet28"), ("expanded", "capsnet40"))):
            for k, variant in enumerate(UNIT_VARIANTS):
                cfg = _unit_config(data_kind, variant)
                # training digits, plus the probe's two passes (full and detached) on its batch after every epoch
                images = cfg["epochs"] * (cfg["train_images"] + (2 * cfg["probe_digits"]))
                register(Unit("04", f"{data_kind}/{variant}", s, unit_run, cfg, unit_probe, family, images,
                              10 + 10 * s + 3 * i + k,
                              f"{VARIANT_LABELS[variant]}, {'28x28 MNIST' if data_kind == 'mnist' else 'expanded MNIST (40x40)'}, "
                              f"{cfg['epochs']} epochs: test accuracy, accuracy with uniform couplings, "
                              f"||v3 - v1|| / ||v1||, coupling entropy" +
                              ("; gradient probe by epoch" if data_kind == "mnist" else "; affNIST-style test; gradient probe by epoch")))


_register_units()


def _declare_paper_scale() -> None:
    """The rows of the chapter's comparison table that the units measure: each variant's test accuracy on MNIST
    and, trained on expanded MNIST, on the affNIST-style digits (the paper's Table 2 reports neither number on
    this footing)."""
    from .units import paper_scale

    words = {"full": "full gradient", "detached": "detached", "uniform": "uniform routing"}
    for v in UNIT_VARIANTS:
        paper_scale(f"test accuracy, {words[v]}", f"04/mnist/{v}", lambda m: m["test_accuracy"], ".4f", row=True)
        paper_scale(f"affNIST-style accuracy, {words[v]}", f"04/expanded/{v}", lambda m: m["affine_accuracy"], ".4f",
                    row=True)


_declare_paper_scale()


# ----------------------------------------------------------------------------- the chapter's paper-scale views

def unit_groups(data_kind: str = "mnist", smoke: bool = False):
    """One group per routing variant (full, detached, uniform) of ``data_kind`` ("mnist", "expanded")."""
    from .units import group

    where = "28×28 digits" if data_kind == "mnist" else "expanded MNIST"
    return [group(f"04/{data_kind}/{v}", f"{VARIANT_LABELS[v]} on {where}", smoke) for v in UNIT_VARIANTS]



def _paired(group, ref, get) -> str:
    """``group`` minus ``ref`` seed by seed: mean ± SD and how many seeds have each sign."""
    a = {r["seed"]: float(get(r)) for r in group.results}
    b = {r["seed"]: float(get(r)) for r in ref.results}
    d = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    if not d:
        return "–"
    return f"{seed_spread(d, '+.4f')} ({sum(x > 0 for x in d)} up, {sum(x < 0 for x in d)} down)"


def variants_frame(groups, test: str = "test"):
    """The three variants on one test set: accuracy (mean ± SD over the seeds run), its paired difference
    to full-gradient routing, the same trained weights with uniform couplings (K = 1), how far routing
    moves the output, the couplings' row entropy against ln J and the second term's share."""
    import pandas as pd

    full = groups[0]
    rows = []
    for v, g in zip(UNIT_VARIANTS, groups):
        r = lambda k: [res["metrics"][f"{test}_routing"][k] for res in g.results]   # noqa: E731
        acc = [res["metrics"][f"{test}_accuracy"] for res in g.results]
        cells = [seed_spread(acc, ".4f"),
                 "–" if v == "full" else _paired(g, full, lambda res: res["metrics"][f"{test}_accuracy"]),
                 seed_spread(r("accuracy_K1_minus_routed"), "+.4f"), seed_spread(r("v_change_mean"), ".3f"),
                 seed_spread(r("row_entropy_over_log_J"), ".4f"),
                 seed_spread([res["metrics"]["second_term"]["ratio"] for res in g.results], ".3f")]
        if not g.results:
            cells = ["not yet run"] + ["–"] * 5
        rows.append((VARIANT_LABELS[v], *cells, len(g.results)))
    cols = ["test accuracy", "minus full gradient (same seed)", "K = 1 minus K = 3, same weights",
            "‖v⁽³⁾ − v⁽¹⁾‖ / ‖v⁽¹⁾‖", "row entropy / ln J", "second term's share", "seeds"]
    return pd.DataFrame(rows, columns=["routing", *cols]).set_index("routing")


def draw_training(groups, title: str = "28×28 digits"):
    """Over the epochs, for each variant with results (mean over its seeds, band from the lowest to the
    highest seed): the relative difference of the full and detached gradients of W, and the couplings'
    row entropy on the probe digits against ln J."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN

    fig, axes = plt.subplots(2, 1, figsize=(COLUMN_IN, 5.6), sharex=True, layout="constrained")
    drawn = 0
    for k, (v, g) in enumerate(zip(UNIT_VARIANTS, groups)):
        if not g.results:
            continue
        runs = [r["history"]["coupling_by_epoch"] for r in g.results]
        ep = np.array(runs[0]["epoch"])
        for ax, key in zip(axes, ("rel_diff", "entropy")):
            c = np.array([r[key] for r in runs])
            ax.plot(ep, c.mean(0), "-", color=f"C{k}",
                    label=f"{VARIANT_LABELS[v]} ({len(runs)} seed{'s' * (len(runs) > 1)})")
            ax.fill_between(ep, c.min(0), c.max(0), color=f"C{k}", alpha=0.15)
        drawn += 1
    if not drawn:
        raise ValueError("draw_training needs at least one result")
    axes[0].set_ylabel("$\\|g_{\\mathrm{full}} - g_{\\mathrm{det}}\\| \\,/\\, \\|g_{\\mathrm{full}}\\|$")
    axes[1].axhline(math.log(10), color="gray", ls="--", lw=0.8, label="$\\ln J$")
    axes[1].set_ylabel("mean row entropy of $c_{ij}$ (nats)")
    axes[1].set_ylim(0, 1.1 * math.log(10))
    axes[1].set_xlabel("epoch (0 = initialisation)")
    axes[1].legend(fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"Probe digits after every epoch, {title}", fontsize=10)
    return fig


def draw_couplings(groups, test: str = "test"):
    """Histogram of the trained networks' last couplings $c_{ij}$ on the test digits, one line per
    variant (its first seed), against the uniform $1/J$."""
    import matplotlib.pyplot as plt

    from .units import decode_array
    from .viz import COLUMN_IN

    fig, ax = plt.subplots(figsize=(COLUMN_IN * 0.8, 3.2), layout="constrained")
    drawn = 0
    for k, (v, g) in enumerate(zip(UNIT_VARIANTS, groups)):
        if not g.results:
            continue
        res = sorted(g.results, key=lambda r: r["seed"])[0]
        h = decode_array(res["arrays"][f"{test}_coupling_hist"]).astype(float)
        edges = np.linspace(0, 1, len(h) + 1)
        ax.step(edges[:-1], h / h.sum(), where="post", color=f"C{k}", label=f"{VARIANT_LABELS[v]}, seed {res['seed']}")
        drawn += 1
    if not drawn:
        raise ValueError("draw_couplings needs at least one result")
    ax.axvline(0.1, color="k", ls=":", lw=1, label="$1/J$")
    ax.set_yscale("log")
    ax.set_xlabel("coupling $c_{ij}$ after three iterations")
    ax.set_ylabel("fraction of couplings")
    ax.legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------- a small world where routing routes

def part_whole_world(n: int, parts: int = 12, wholes: int = 4, dim: int = 4, noise: float = 0.1,
                     pose_scale: float = 2.0, seed: int = 0, frames: torch.Tensor | None = None):
    """Synthetic part capsules whose agreement decides the whole, for chapter 4's small world.

    Each whole ``j`` sees each part ``i`` in its own frame: a fixed random rotation ``A_ij``. An
    example is one whole ``y`` with a random pose ``p`` (a vector of length about ``pose_scale``);
    part ``i`` then has the pose ``u_i = A_{yi}^T p`` plus Gaussian noise of SD ``noise``. All parts
    are present in every example, so which whole it is can be read only from whether the parts'
    poses agree after each whole's transformation, which is what routing by agreement measures.
    Returns ``(u (n, parts, dim), y (n,), frames (wholes, parts, dim, dim))``; pass ``frames`` to draw
    a test set of the same world."""
    if min(n, parts, wholes, dim) < 1 or wholes < 2:
        raise ValueError(f"need n, parts, dim >= 1 and wholes >= 2; got {n}, {parts}, {wholes}, {dim}")
    g = torch.Generator().manual_seed(seed)
    if frames is None:
        q, _ = torch.linalg.qr(torch.randn(wholes, parts, dim, dim, generator=g, dtype=torch.float64))
        frames = q.float()
    elif frames.shape[:2] != (wholes, parts) or frames.shape[-1] != dim:
        raise ValueError(f"frames of shape {tuple(frames.shape)} do not fit wholes={wholes}, parts={parts}, dim={dim}")
    y = torch.randint(0, wholes, (n,), generator=g)
    p = torch.randn(n, dim, generator=g)
    p = pose_scale * p / p.norm(dim=1, keepdim=True).clamp_min(1e-6)
    u = torch.einsum("nipq,np->niq", frames[y], p) + noise * torch.randn(n, parts, dim, generator=g)
    return u, y, frames


class PartWholeCaps(torch.nn.Module):
    """One capsule layer on given part capsules: votes ``W_ij u_i`` and dynamic routing (``iterations``,
    ``detach`` as in :func:`capslib.dynamic_routing`); the class is the longest output capsule.

    Shaped like the book's CapsNet, so that :mod:`capslib.rem` and :mod:`capslib.pruning` take it as they
    are (chapter 6 prunes it): the routed layer is ``digit``, a :class:`capslib.layers.DenseCaps` (pruning
    masks and a swapped ``routing_fn`` act on it), the primary capsules are the input itself, there is no
    decoder. The initial weights come from ``seed`` alone; the global random state is left as it was."""

    def __init__(self, parts: int, wholes: int, dim: int, iterations: int = 3, detach: bool = False, seed: int = 0):
        from ..layers import DenseCaps

        super().__init__()
        self.primary = torch.nn.Identity()
        with torch.random.fork_rng(devices=[]):   # DenseCaps draws its own initial W; this one replaces it
            self.digit = DenseCaps(parts, dim, wholes, dim, iterations, detach)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.digit.W.copy_(0.5 * torch.randn(parts, wholes, dim, dim, generator=g) / dim ** 0.5)

    @property
    def iterations(self) -> int:
        return self.digit.iterations

    @property
    def detach(self) -> bool:
        return self.digit.detach

    def primary_capsules(self, u: torch.Tensor) -> torch.Tensor:
        return u

    def votes(self, u: torch.Tensor) -> torch.Tensor:
        return self.digit.votes(u)

    def encode(self, u: torch.Tensor):
        return self.digit(u)

    def forward(self, u: torch.Tensor, iterations: int | None = None):
        return self.digit.routing_fn(self.votes(u), iterations or self.digit.iterations, self.digit.detach)


def train_part_whole(variant: str, u, y, epochs: int, seed: int, lr: float = 0.01, batch: int = 64) -> PartWholeCaps:
    """Train :class:`PartWholeCaps` on ``(u, y)`` with the margin loss: ``variant`` is ``full``,
    ``detached`` or ``uniform`` (one iteration), from the same seed for all three."""
    from ..ops import margin_loss
    detach, iterations = {"full": (False, 3), "detached": (True, 3), "uniform": (False, 1)}[variant]
    net = PartWholeCaps(u.shape[1], int(y.max()) + 1, u.shape[2], iterations, detach, seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(u), generator=g).split(batch):
            v, _ = net(u[idx])
            loss = margin_loss(v.norm(dim=-1), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net


@torch.no_grad()
def part_whole_effect(net: PartWholeCaps, u, y) -> dict:
    """On ``(u, y)``: accuracy routed (three iterations) and with uniform couplings, the mean
    ||v(3) - v(1)|| / ||v(1)||, and the couplings' mean row entropy over ln J."""
    v3, c = net(u, 3)
    v1, _ = net(u, 1)
    J = c.shape[-1]
    ent = -(c * c.clamp_min(1e-30).log()).sum(-1).mean()
    return {"accuracy_routed": float((v3.norm(dim=-1).argmax(1) == y).float().mean()),
            "accuracy_K1": float((v1.norm(dim=-1).argmax(1) == y).float().mean()),
            "v_change_mean": float(((v3 - v1).flatten(1).norm(dim=1) / v1.flatten(1).norm(dim=1)).mean()),
            "row_entropy_over_log_J": float(ent) / math.log(J)}


def part_whole_second_term(net: PartWholeCaps, u, y) -> float:
    """The second term's share of the votes' gradient (GT1) for ``net``'s votes on ``(u, y)``, three
    iterations, float64 (:func:`second_term_share`)."""
    return second_term_share(net.votes(u), y, 3)


# ----------------------------------------------------------------------------- the polarization study's threshold and upstream gradient

def relative_low(J: int, factor: float = 0.1) -> float:
    """The "decided against" threshold ``factor / J``: a tenth of the uniform coupling ``1/J``
    by default (chapter 4). A fixed 0.1 would be the uniform value itself when ``J = 10``."""
    check_positive_int("J", J)
    if not 0 < factor < 1:
        raise ValueError(f"factor must lie in (0, 1); got {factor}")
    return factor / J


def margin_upstream(u_hat: torch.Tensor, y: torch.Tensor, iterations: int = 3, logit_scale: float = 1.0,
                    vote_scale: float = 1.0):
    """Votes ``alpha * u_hat`` and the margin loss's ``dL/dv`` *for that routing* (chapter 4).

    The polarization knobs change the routing output ``v``, hence the loss and its gradient
    ``dL/dv``: a study over ``lambda`` (``logit_scale``) or ``alpha`` (``vote_scale``) must
    recompute it at every setting rather than reuse the one of ``lambda = alpha = 1``.

    Returns:
        ``(votes (B, I, J, D), grad_v (B, J, D))``, both detached.
    """
    from ..ops import margin_loss

    _check_votes(u_hat)
    check_positive_int("iterations", iterations)
    _check_scale(logit_scale)
    _check_scale(vote_scale, "vote_scale")
    if y.dim() != 1 or y.shape[0] != u_hat.shape[0]:
        raise ValueError(f"y must be (B,) = ({u_hat.shape[0]},) labels; got {tuple(y.shape)}")
    votes = float(vote_scale) * u_hat.detach()
    with torch.no_grad():
        v, _ = scaled_routing(votes, iterations, logit_scale)
    v = v.requires_grad_(True)
    with torch.enable_grad():
        (gv,) = torch.autograd.grad(margin_loss(v.norm(dim=-1), y), v)
    return votes, gv.detach()
