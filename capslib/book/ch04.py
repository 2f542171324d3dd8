"""Chapter 4 (the coupling-gradient proof): its sizes per profile
(``capslib.book.profiles.settings("04_coupling_gradient_proof")``), the measurements it takes on a
training CapsNet (:func:`digit_gradients`, :class:`CouplingProbe`, :func:`step_cost`) and its graphs
of what autograd connects (:func:`autograd_graph`, :func:`semantic_graph` and their drawings).

The chapter's mathematics, the two gradient terms and the polarization of the couplings, is the
library's :mod:`capslib.coupling_gradient`.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from . import profiles
from ..checks import check_positive_int, check_tensor
from ..coupling_gradient import polarization, relative_low

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
# (with batches of 64 they stopped near 0.5-0.75).
profiles.register(
    CHAPTER,
    ci=dict(dataset="embedded", image_size=28, conv_channels=32, primary_types=4, primary_dim=8, digit_dim=16,
            decoder=(128, 256), iterations=3, epochs=3, batch_size=64, lr=2e-3, recon_weight=0.0005,
            train_subset=2200, seeds=3, probe_size=64, probe_every=16, cost_pairs=20,
            expanded_subset=1200, expanded_epochs=4, expanded_conv_channels=16, expanded_primary_types=4,
            expanded_primary_stride=3, expanded_batch_size=16, expanded_lr=4e-3),
    full=dict(dataset="mnist", image_size=28, conv_channels=256, primary_types=32, primary_dim=8, digit_dim=16,
              decoder=(512, 1024), iterations=3, epochs=10, batch_size=128, lr=1e-3, recon_weight=0.0005,
              train_subset=None, seeds=3, probe_size=500, probe_every=100, cost_pairs=20,
              expanded_subset=None, expanded_epochs=5, expanded_conv_channels=256, expanded_primary_types=32,
              expanded_primary_stride=2, expanded_batch_size=128, expanded_lr=1e-3),
    # `full` is cut to fit one H100 in minutes: the chapter took about 7 (28x28 epochs 3.5 s with the
    # full gradient, 3.0 s detached; README "GPU use"); CAPSBOOK_PAPER_SCHEDULE=1 restores Table 1's
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
    from ..timing import interleaved_seconds

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
    :func:`~capslib.coupling_gradient.relative_low`, a tenth of the uniform ``1/J``); the
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
