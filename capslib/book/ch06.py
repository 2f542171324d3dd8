"""Chapter 6 (REM): its sizes per profile (``capslib.book.profiles.settings("06_rem")``), its
experiment (:func:`compare_methods`: vanilla, REM, magnitude pruning and SNIP networks from one
seed, with :class:`LevelTracker` recording the quantized accuracy and entropy after every epoch)
and its drawings of the parse trees of a fully connected CapsNet (:func:`parse_tree_graph`,
:func:`draw_parse_tree`).

The chapter's mathematics is the library's: quantization, dictionaries and their entropy in
:mod:`capslib.rem`, the pruning in :mod:`capslib.pruning`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from . import profiles
from ..pruning import (LobsterPruner, MagnitudeSchedulePruner, MatchedPruner, prunable, set_mask, snip_masks,
                       sparsity)
from ..rem import FCOutput, level_sweep, margin_loss_fn, predict_lengths

profiles.register(
    "06_rem",
    # CPU, embedded digits: a small DR-CapsNet without decoder (the paper removes it,
    # App. C.2) trained on a 1,500-digit subset, every method from `seeds` seeds (seed + k);
    # REM and iterative magnitude pruning branch from the vanilla run after `pretrain_epochs`
    # (a shared start); SNIP starts from initialization by definition. Two pruning epochs of
    # 47 steps are about a hundred optimizer steps, so LOBSTER's lambda is raised from 1e-4 to
    # 5e-3 and each threshold search may worsen the validation loss by `lobster_tolerance`
    # (relative). Subset and epochs are what fits three seeds of four networks into the
    # notebook's two minutes on two CPU cores; the fully connected CapsNet trains on a smaller subset.
    ci=dict(dataset="embedded", conv_channels=16, primary_types=8, primary_dim=8, digit_dim=8,
            iterations=3, train_subset=1500, epochs=4, pretrain_epochs=2, batch_size=32, lr=2e-3,
            lr_decay=0.99, levels=11, levels_sweep=(2, 3, 5, 7, 9, 11, 16, 21, 31), lobster_lambda=5e-3,
            lobster_decay=0.99, lobster_tolerance=0.02, search_steps=7, imp_final_sparsity=0.8,
            lobster_sensitivity="max", imp_matched=True, ablation=True,
            snip_batch=256, fc_conv_channels=16, fc_epochs=4, fc_pretrain_epochs=2, fc_batch_size=64,
            fc_train_subset=1000, seeds=3),
    # The paper's MNIST setting (Sec. 4, App. B): DR-CapsNet of Sabour et al. without
    # decoder, batch 128, Adam with lr decay 0.99 per epoch, K = 11, five seeds; LOBSTER with
    # lambda = 1e-4 (our choice: the paper does not print it) and no loss worsening, trained
    # from scratch (no shared start). The paper stops early with a patience of 200 epochs; `full`
    # trains 15 epochs from 3 seeds so that the chapter fits one GPU: capslib.tools.bench measured
    # 15.7k images/s for this network on one H100, so 3 seeds x 4 networks x 15 epochs of 55,000
    # digits take about 10.5 minutes of training (plus LOBSTER's threshold searches and the FC
    # network). CAPSBOOK_PAPER_SCHEDULE=1 trains 200 epochs from 5 seeds (about 2.6 hours).
    full=dict(dataset="mnist", conv_channels=256, primary_types=32, primary_dim=8, digit_dim=16,
              iterations=3, train_subset=None, epochs=15, pretrain_epochs=0, batch_size=128, lr=1e-3,
              lr_decay=0.99, levels=11, levels_sweep=(2, 3, 5, 7, 9, 11, 16, 21, 31, 65, 129),
              lobster_lambda=1e-4, lobster_decay=0.99, lobster_tolerance=0.0, search_steps=12,
              lobster_sensitivity="max", imp_matched=True, ablation=True,
              imp_final_sparsity=0.85, snip_batch=512, fc_conv_channels=256, fc_epochs=15,
              fc_pretrain_epochs=0, fc_batch_size=128, fc_train_subset=None, seeds=3),
    paper=dict(epochs=200, seeds=5, fc_epochs=100),
)


# ----------------------------------------------------------------------------- the experiment

METHODS = ("vanilla (+Q)", "REM (LOBSTER)", "IMP", "SNIP")
#: the ablation run of chapter 6 (trained when the settings have ``ablation=True``): LOBSTER's
#: shrinkage with the gate removed (plain weight decay), pruned by magnitude to REM's sparsities
WEIGHT_DECAY = "weight decay"


def make_capsnet(S, seed: int, device=None) -> nn.Module:
    """Chapter 6's DR-CapsNet without decoder at the sizes of settings ``S``, initialised from ``seed``."""
    from ..models import CapsNet

    torch.manual_seed(seed)
    net = CapsNet(conv_channels=S.conv_channels, primary_types=S.primary_types, primary_dim=S.primary_dim,
                  digit_dim=S.digit_dim, decoder=(), iterations=S.iterations)
    return net.to(device) if device is not None else net


def encoder_parameters(net: nn.Module, nonzero: bool = False) -> int:
    """Parameters of a CapsNet's encoder (convolution, primary capsules, class capsules); no decoder."""
    from ..models import count_parameters

    return sum(count_parameters(m, nonzero=nonzero) for m in (net.conv, net.primary, net.digit))


def compare_methods(seed: int, S, train_split, val, test, *, track: bool = False, device=None,
                    progress: bool = True, report_val: bool = False, prefix: str = "06_rem") -> dict:
    """Chapter 6's experiment for one seed: vanilla, REM (LOBSTER), IMP and SNIP DR-CapsNets.

    The vanilla network trains ``S.epochs`` epochs; its first ``S.pretrain_epochs`` are a shared
    start from which REM and IMP branch and train the remaining epochs (every network sees
    ``S.epochs`` epochs); SNIP prunes the initial weights to the sparsity REM ended with and
    trains ``S.epochs`` epochs from there. Every run is train-or-load through keyed checkpoints
    named ``{prefix}_<run>_s{seed}``; the seed fixes the initial weights and the minibatch order.
    ``track`` records, after every epoch, the test accuracy, entropy and keys for each ``K`` in
    ``S.levels_sweep`` (``history["levels"]``, :class:`LevelTracker`). ``val`` guards LOBSTER's
    threshold; ``report_val`` also scores it after every epoch of every run (``history["val_acc"]``).

    Returns ``{"seed", "nets": {method: model}, "params": {method: pruned weights or None},
    "history": {"start", method: history}, "seconds": {method: wall seconds}}`` (methods:
    :data:`METHODS`; the vanilla history continues the start's, so it holds all ``S.epochs``).
    """
    import copy
    import time

    from .. import train as _train

    def tracker():
        return LevelTracker(test, S.levels_sweep) if track else None

    fit_args = dict(batch_size=S.batch_size, lr=S.lr, lr_decay=S.lr_decay, val=val if report_val else None,
                    predict=predict_lengths,
                    seed=seed, progress=progress)
    ckpt = lambda name: _train.checkpoint_path(f"{prefix}_{name}_s{seed}")
    rest = S.epochs - S.pretrain_epochs
    nets, params, hist, secs = {}, {}, {}, {}

    t0 = time.perf_counter()
    vanilla = make_capsnet(S, seed, device)
    start_ckpt = ckpt("start")
    hist["start"] = _train.fit(vanilla, train_split, margin_loss_fn, epochs=S.pretrain_epochs, checkpoint=start_ckpt,
                               on_epoch_end=tracker(), desc=f"shared start (seed {seed})", **fit_args)
    shared_start = copy.deepcopy(vanilla.state_dict())
    vanilla = make_capsnet(S, seed, device)  # the same initial weights: the vanilla run continues the start
    hist[METHODS[0]] = _train.fit(vanilla, train_split, margin_loss_fn, epochs=S.epochs, checkpoint=ckpt("vanilla"),
                                  start_from=start_ckpt, on_epoch_end=tracker(), desc=f"vanilla (seed {seed})",
                                  **fit_args)
    nets[METHODS[0]], params[METHODS[0]] = vanilla, None
    secs[METHODS[0]] = time.perf_counter() - t0

    def branch(method: str, run: str, pruner_for, tracked: bool = True) -> list:
        """Continue the shared start with a pruner made by ``pruner_for(prunable weights)``."""
        t0 = time.perf_counter()
        net = make_capsnet(S, seed, device)
        net.load_state_dict(shared_start)
        pruned = prunable(net)
        pruner = pruner_for(pruned)
        hist[method] = _train.fit(net, train_split, margin_loss_fn, epochs=rest, checkpoint=ckpt(run),
                                  before_step=getattr(pruner, "before_step", None),
                                  on_epoch_end=chain(pruner.on_epoch_end, tracker() if tracked else None),
                                  desc=f"{method.split(' ')[0]} (seed {seed})", **fit_args)
        nets[method], params[method] = net, pruned
        secs[method] = time.perf_counter() - t0
        return pruned

    rem_params = branch(METHODS[1], "rem", lambda w: LobsterPruner(
        w, val, lam=S.lobster_lambda, decay=S.lobster_decay, tolerance=S.lobster_tolerance, steps=S.search_steps,
        sensitivity=getattr(S, "lobster_sensitivity", None)))
    rem_path = list(hist[METHODS[1]].get("sparsity", [])) or [sparsity(rem_params)]
    if getattr(S, "imp_matched", False):   # magnitude alone, to REM's sparsity after each epoch
        branch(METHODS[2], "imp_matched", lambda w: MatchedPruner(w, rem_path, lam=0.0))
    else:
        branch(METHODS[2], "imp", lambda w: MagnitudeSchedulePruner(w, S.imp_final_sparsity, rest))
    if getattr(S, "ablation", False):      # LOBSTER's shrinkage without its gate, same sparsities
        branch(WEIGHT_DECAY, "wd", lambda w: MatchedPruner(w, rem_path, lam=S.lobster_lambda, decay=S.lobster_decay,
                                                           sensitivity="none"), tracked=False)

    t0 = time.perf_counter()
    snip_net = make_capsnet(S, seed, device)
    snip_params = prunable(snip_net)
    target = sparsity(rem_params)
    masks = snip_masks(snip_net, snip_params, margin_loss_fn, train_split.x[:S.snip_batch],
                       train_split.y[:S.snip_batch], target)
    for (module, name), mask in zip(snip_params, masks):
        set_mask(module, name, mask)
    hist[METHODS[3]] = _train.fit(snip_net, train_split, margin_loss_fn, epochs=S.epochs, checkpoint=ckpt("snip"),
                                  on_epoch_end=tracker(), desc=f"SNIP (seed {seed})", **fit_args)
    nets[METHODS[3]], params[METHODS[3]] = snip_net, snip_params
    secs[METHODS[3]] = time.perf_counter() - t0
    return {"seed": seed, "nets": nets, "params": params, "history": hist, "seconds": secs}


# ----------------------------------------------------------------------------- callbacks

class LevelTracker:
    """``on_epoch_end`` that appends, after every epoch, the quantized accuracy, entropy and
    keys per class for each ``K`` on ``split`` to ``history["levels"]`` (Fig. 8 and 10)."""

    def __init__(self, split, levels: Sequence[int] = (11,), params=None):
        self.split, self.levels, self.params = split, tuple(levels), params

    def __call__(self, epoch, model, history) -> None:
        res = level_sweep(model, self.split, self.levels)
        history.setdefault("levels", []).append(
            {str(K): {k: res[K][k] for k in ("accuracy", "entropy", "entropy_mm", "keys")} for K in self.levels})
        if self.params is not None and "sparsity" not in history:
            history.setdefault("weight_sparsity", []).append(sparsity(self.params))


def chain(*callbacks: Callable | None) -> Callable:
    """One ``on_epoch_end`` that calls several in order (None entries skipped)."""
    cbs = [c for c in callbacks if c is not None]

    def run(epoch, model, history):
        for cb in cbs:
            cb(epoch, model, history)
    return run


# ----------------------------------------------------------------------------- parse-tree graphs of the FC CapsNet

def parse_tree_graph(out: FCOutput, sample: int = 0, threshold: str | float = "uniform"):
    """The parse tree of one sample by backtracking (Sec. 3.2.2; chapter 6) as a networkx DiGraph.

    Start from the predicted class capsule; keep an edge ``i -> j`` from layer ``l`` to an
    already kept capsule ``j`` of layer ``l+1`` when its coupling exceeds ``threshold``
    (``"uniform"``: ``1/|Omega^[l+1]|``, the value of an undecided capsule); continue
    from the kept children. Every capsule is a node (``layer``, ``index``, ``activation`` =
    its length, ``in_tree``); kept edges carry ``weight`` = the coupling.
    """
    import networkx as nx

    G = nx.DiGraph()
    acts = [c[sample].norm(dim=-1).detach().cpu() for c in out.capsules]
    for l, a in enumerate(acts):
        for i, val in enumerate(a.tolist()):
            G.add_node((l, i), layer=l, index=i, activation=val, in_tree=False)
    L = len(acts) - 1
    pred = int(acts[L].argmax())
    G.nodes[(L, pred)]["in_tree"] = True
    frontier = {pred}
    for l in range(L - 1, -1, -1):
        c = out.couplings[l][sample].detach().cpu()                        # (N_l, N_{l+1})
        thr = 1.0 / c.shape[1] if threshold == "uniform" else float(threshold)
        children = set()
        for j in sorted(frontier):
            for i in torch.nonzero(c[:, j] > thr).flatten().tolist():
                G.add_edge((l, i), (l + 1, j), weight=float(c[i, j]))
                children.add(i)
        for i in children:
            G.nodes[(l, i)]["in_tree"] = True
        frontier = children
        if not frontier:
            break
    G.graph["predicted"] = pred
    return G


def draw_parse_tree(G, ax=None, title: str | None = None, cmap: str = "viridis"):
    """Draw a :func:`parse_tree_graph`: layers left to right, node colour = capsule length,
    tree nodes outlined, edge width and opacity = coupling. Returns the Axes."""
    import matplotlib.pyplot as plt
    import networkx as nx

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    layers: dict = {}
    for node, d in G.nodes(data=True):
        layers.setdefault(d["layer"], []).append(node)
    pos = {}
    for l, nodes in layers.items():
        n = len(nodes)
        for node in nodes:
            pos[node] = (l, (n - 1) / 2 - G.nodes[node]["index"])
    nodes = list(G.nodes)
    colors = [G.nodes[n]["activation"] for n in nodes]
    edgecolors = ["black" if G.nodes[n]["in_tree"] else "lightgray" for n in nodes]
    nx.draw_networkx_nodes(G, pos, nodelist=nodes, node_color=colors, cmap=cmap, vmin=0, vmax=1,
                           node_size=60, edgecolors=edgecolors, linewidths=1.0, ax=ax)
    edges = list(G.edges(data=True))
    if edges:
        w = [d["weight"] for _, _, d in edges]
        nx.draw_networkx_edges(G, pos, edgelist=[(a, b) for a, b, _ in edges], width=[0.5 + 3 * x for x in w],
                               alpha=0.7, edge_color="tab:red", arrows=False, ax=ax)
    ax.tick_params(bottom=True, labelbottom=True, left=False, labelleft=False)
    ax.set_xticks(range(len(layers)))
    names = ["primary"] + [f"hidden {k}" for k in range(1, len(layers) - 1)] + ["class"]
    ax.set_xticklabels(names[:len(layers)])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("capsule layer")
    if title:
        ax.set_title(title)
    return ax
