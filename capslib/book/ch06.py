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

import numpy as np
import torch
from torch import nn

from . import profiles
from .units import built_in_float64, cuda_speed_settings, seed_spread, step_summary
from ..pruning import (LobsterPruner, _orig, apply_global_magnitude, attach_masks, prunable, set_mask,
                       sparsity)
from ..rem import FCOutput, last_couplings, level_sweep, margin_loss_fn, predict_lengths, tree_threshold

# The small world where couplings leave 1/J (world_compare), the same at every profile (seconds on a
# CPU): chapter 4's part-whole world (parts, wholes, pose dimension, pose noise SD, pose length), its
# training, validation and test examples, epochs (the first `world_pretrain_epochs` a shared start, as in the
# MNIST run), batch, Adam's learning rate, LOBSTER's lambda, tolerance and search steps (the `ci` MNIST
# run's: with these sizes the pruning epochs take about as many steps as there), seeds, the levels K measured, and the margin of
# practical equivalence of two methods' entropies in bits, declared before the runs.
WORLD = dict(world_parts=8, world_wholes=4, world_dim=4, world_noise=1.0, world_scale=5.0, world_train=1500,
             world_val=500, world_test=1000, world_epochs=8, world_pretrain_epochs=4, world_batch=64, world_lr=0.01,
             world_lambda=5e-3, world_tolerance=0.02, world_search_steps=7, world_seeds=5, world_levels=(5, 7, 11), world_margin=0.25)

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
    # bootstrap_draws: resamples of the test digits for each run's entropy (capslib.rem.bootstrap_entropy).
    ci=dict(dataset="embedded", conv_channels=16, primary_types=8, primary_dim=8, digit_dim=8,
            iterations=3, train_subset=1500, epochs=4, pretrain_epochs=2, batch_size=32, lr=2e-3,
            lr_decay=0.99, levels=11, levels_sweep=(2, 3, 5, 7, 9, 11, 16, 21, 31), lobster_lambda=5e-3,
            lobster_decay=0.99, lobster_tolerance=0.02, search_steps=7, imp_final_sparsity=0.8,
            lobster_sensitivity="max", imp_matched=True, ablation=True,
            snip_batch=256, fc_conv_channels=16, fc_epochs=4, fc_pretrain_epochs=2, fc_batch_size=64,
            fc_train_subset=1000, seeds=3, bootstrap_draws=1000, **WORLD),
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
              fc_pretrain_epochs=0, fc_batch_size=128, fc_train_subset=None, seeds=3, bootstrap_draws=1000, **WORLD),
    paper=dict(epochs=200, seeds=5, fc_epochs=100),
)


# ----------------------------------------------------------------------------- the experiment

METHODS = ("vanilla (+Q)", "REM (LOBSTER)", "MP", "SNIP")
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
    """Chapter 6's experiment for one seed: vanilla, REM (LOBSTER), MP (magnitude pruning alone) and SNIP DR-CapsNets.

    The vanilla network trains ``S.epochs`` epochs; its first ``S.pretrain_epochs`` are a shared
    start from which REM and MP branch and train the remaining epochs (every network sees
    ``S.epochs`` epochs); SNIP prunes the initial weights to the sparsity REM ended with and
    trains ``S.epochs`` epochs from there. Every run is train-or-load through keyed checkpoints
    named ``{prefix}_<run>_s{seed}``; the seed fixes the initial weights and the minibatch order.
    ``track`` records, after every epoch, the test accuracy, entropy and keys for each ``K`` in
    ``S.levels_sweep`` (``history["levels"]``, :class:`LevelTracker`). ``val`` guards LOBSTER's
    threshold; ``report_val`` also scores it after every epoch of every run (``history["val_acc"]``).

    Returns ``{"seed", "nets": {method: model}, "params": {method: pruned weights or None},
    "history": {"start", method: history}, "seconds": {method: wall seconds}, "start": the shared start's
    state dict}`` (methods: :data:`METHODS`; the vanilla history continues the start's, so it holds all
    ``S.epochs``; with no pretraining epochs, as at ``full``, the start is the initial weights).
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
                                                           sensitivity="none"))

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
    return {"seed": seed, "nets": nets, "params": params, "history": hist, "seconds": secs, "start": shared_start}


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


def entropy_at_accuracy(path: Sequence[tuple[float, float]], accuracy: float) -> float | None:
    """The entropy a training path ``[(accuracy, entropy) after each epoch]`` has at ``accuracy``: linear
    between the latest two consecutive epochs whose accuracies bracket it; None where no pair does."""
    for e in range(len(path) - 1, 0, -1):
        (a0, h0), (a1, h1) = path[e - 1], path[e]
        if min(a0, a1) <= accuracy <= max(a0, a1):
            return h1 if a1 == a0 else h0 + (accuracy - a0) / (a1 - a0) * (h1 - h0)
    return path[-1][1] if path and path[-1][0] == accuracy else None


def matched_accuracy(reference: Sequence[tuple[float, float]], other: Sequence[tuple[float, float]]) -> dict:
    """Two networks' entropies where they are equally accurate: at the lower of their final accuracies,
    each read off its own training path (:func:`entropy_at_accuracy`). ``{"accuracy", "reference",
    "other", "difference"}`` (other - reference; None where a path does not reach that accuracy)."""
    if not reference or not other:
        raise ValueError("matched_accuracy needs two non-empty paths of (accuracy, entropy) per epoch")
    a = min(reference[-1][0], other[-1][0])
    h_ref, h_other = entropy_at_accuracy(reference, a), entropy_at_accuracy(other, a)
    diff = None if h_ref is None or h_other is None else h_other - h_ref
    return {"accuracy": a, "reference": h_ref, "other": h_other, "difference": diff}


def matched_reading(differences: dict) -> tuple:
    """Read ``{seed: difference at matched accuracy or None}`` (the ``"difference"`` of
    :func:`matched_accuracy` per seed): the :class:`capslib.book.stats.Summary` over the seeds where both
    paths reach the matched accuracy (None when no seed's do), and its numbers in words for the page.
    A profile where one network ends below the other's first epoch has no such seed; the page then says so
    instead of stopping."""
    from . import stats

    reached = {s: d for s, d in differences.items() if d is not None}
    if not reached:
        return None, (f"not readable: in none of the {len(differences)} seeds do both training paths reach "
                      f"a common accuracy")
    below = sum(d < 0 for d in reached.values())
    summary = stats.summarise(reached.values(), list(reached))
    if len(reached) == 1:
        (seed, d), = reached.items()
        return summary, (f"{d:.2f} bits (seed {seed} alone has both paths reach that accuracy, so no interval; "
                         f"{'below' if d < 0 else 'not below'} zero)")
    of = "" if len(reached) == len(differences) else f" of {len(differences)}"
    return summary, (f"{summary.mean:.2f} ± {summary.half:.2f} bits (95 % interval over the {len(reached)}{of} seeds "
                     f"where both paths reach that accuracy; below zero in {below} of them)")


# ----------------------------------------------------------------------------- parse-tree graphs of the FC CapsNet

def parse_tree_graph(out: FCOutput, sample: int = 0, threshold: str | float = "uniform", levels: int | None = None):
    """The parse tree of one sample by backtracking (Sec. 3.2.2; chapter 6) as a networkx DiGraph.

    Start from the predicted class capsule; keep an edge ``i -> j`` from layer ``l`` to an
    already kept capsule ``j`` of layer ``l+1`` when its coupling exceeds ``capslib.rem.tree_threshold``
    (``"uniform"``: ``1/|Omega^[l+1]|``, the value of an undecided capsule, quantized into ``levels``
    levels when the couplings are); continue
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
        thr = tree_threshold(c.shape[1], threshold, levels)
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
    tree nodes outlined in black, edge width = coupling. Returns the Axes."""
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


# ============================================================================= paper scale as experiment units
#
# The trainings chapter 6's paper-scale claims rest on, one unit per configuration and seed (see
# :mod:`capslib.book.units`), on all 55,000 training digits at the paper's sizes (DR-CapsNet without
# decoder, batch 128, Adam 1e-3 decayed by 0.99 per epoch, K = 11):
#
# - ``06/vanilla/s<k>``: the unpruned network. Measured on the 10,000 test digits: accuracy with float
#   and with quantized couplings, and the parse-tree entropy, its Miller-Madow correction, keys per
#   class and the share of couplings at the level 1/J, for every K of the sweep; accuracy and
#   entropy at K = 11 after every epoch.
# - ``06/pruned/s<k>``: four networks from the same seed, one after the other: REM (LOBSTER during
#   training, the gate normalised per tensor), then magnitude pruning alone ("MP") and weight decay
#   (LOBSTER's shrinkage without its gate), each pruned by magnitude to the sparsity REM reached after
#   the same epoch, then SNIP at REM's final sparsity. One unit, because the controls are matched to
#   REM's sparsities: it needs no result of another unit. The same measurements per network, plus
#   its sparsity after every epoch, the share of gated weights, and the class-capsule weight blocks
#   W_ij that are entirely zero and the capsules all of whose blocks are (silenced).
#
# Schedule: UNIT_SCHEDULE["epochs"] epochs per network (the `full` profile's) where the paper stops
# early with a patience of 200 epochs: four networks of that length fit one unit.

UNIT_SEEDS = tuple(range(5))          # the paper's five runs
UNIT_METHODS = ("REM (LOBSTER)", "MP", WEIGHT_DECAY, "SNIP")
UNIT_LEVELS = (2, 3, 5, 7, 9, 11, 16, 21, 31, 65, 129)
UNIT_SCHEDULE = dict(version=1, dataset="mnist", split_seed=0, validation=5000, train_images=55_000, epochs=15,
                     batch_size=128, lr=1e-3, lr_decay=0.99, levels=11, levels_sweep=list(UNIT_LEVELS),
                     lobster_lambda=1e-4, lobster_decay=0.99, lobster_tolerance=0.0, search_steps=12,
                     lobster_sensitivity="max", snip_batch=512, eval_batch=250, test_images=10_000,
                     precision="float32 weights and activations, TF32 products and convolutions",
                     step="fit's fast path where no pruning hook runs between backward and step (vanilla, "
                          "SNIP: whole batches, fused Adam, a CUDA graph where the capture works); the "
                          "eager step where one does (REM, IMP, weight decay)")
UNIT_CAPSNET = dict(conv_channels=256, primary_types=32, primary_dim=8, digit_dim=16, iterations=3)
UNIT_SMOKE = dict(dataset="embedded", epochs=1, batch_size=32, train=256, val=100, test=200, snip_batch=64,
                  search_steps=3, capsnet=dict(conv_channels=8, primary_types=2, primary_dim=8, digit_dim=8,
                                               iterations=3))


def _unit_sizes(unit, smoke: bool):
    from types import SimpleNamespace

    return SimpleNamespace(**(UNIT_SMOKE["capsnet"] if smoke else unit.config["capsnet"]))


def unit_probe(unit) -> dict:
    """One training step of the unit's first network at full size in float64 on the CPU (weights drawn
    from seed 0, four seeded random digits, the margin loss): loss and per-parameter gradient norms; for
    ``06/pruned`` also how far LOBSTER's gated shrinkage moves each pruned tensor in that step."""
    from ..pruning import lobster_step

    net = built_in_float64(lambda: make_capsnet(_unit_sizes(unit, False), 0))
    x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = torch.tensor([0, 3, 7, 9])
    loss, _ = margin_loss_fn(net, x, y)
    loss.backward()
    out = step_summary(loss, x, net)
    if unit.config["kind"] == "pruned":
        params = prunable(net)
        before = [getattr(m, n).detach().clone() for m, n in params]
        with torch.no_grad():
            lobster_step(params, unit.config["lobster_lambda"], unit.config["lobster_sensitivity"])
        for (m, n), b in zip(params, before):
            out[f"shrink:{type(m).__name__}.{n}"] = float((getattr(m, n).detach() - b).norm())
    return out


@torch.no_grad()
def class_weights(net) -> torch.Tensor:
    """The class-capsule weights ``W (I, J, D_out, D_in)`` as they act, pruning masks applied."""
    from ..pruning import effective_weight

    d = net.digit
    return (effective_weight(d, "W") if hasattr(d, "W_orig") else d.W).detach()


@torch.no_grad()
def weight_blocks(net) -> dict:
    """The class-capsule weights ``W (I, J, D_out, D_in)`` block by block: the share of blocks W_ij that
    are entirely zero, and how many input capsules have every block zero (silenced: c_ij = 1/J)."""
    W = class_weights(net)
    zero = W.flatten(2).abs().amax(-1) == 0                   # (I, J)
    return {"zero_blocks": float(zero.float().mean()), "silenced_capsules": int(zero.all(1).sum()),
            "input_capsules": int(W.shape[0])}


def unit_measure(net, test, levels, K: int = 11) -> tuple[dict, dict]:
    """A trained network on the test digits: float and quantized accuracy, entropy (plug-in and
    Miller-Madow), its ceiling, keys per class and the share of couplings at the level 1/J, for every K
    in ``levels``; the histogram of the couplings to the predicted class at ``K``."""
    from ..rem import entropy_ceiling
    from .units import encode_array

    sw = level_sweep(net, test, levels)
    J = net.digit.out_caps
    by_K = {}
    for k in levels:
        r = sw[k]
        ceiling = float(entropy_ceiling(r["predicted"], J).mean())
        by_K[str(k)] = {"accuracy": r["accuracy"], "entropy": r["entropy"], "entropy_mm": r["entropy_mm"],
                        "ceiling": ceiling, "keys_mean": float(np.mean(r["keys"])), "keys": r["keys"]}
        if (k - 1) % J == 0:
            by_K[str(k)]["share_uniform_level"] = float((r["codes"] == (k - 1) // J).float().mean())
    m = {"float_accuracy": sw["float"]["accuracy"], "by_K": by_K, **weight_blocks(net)}
    return m, {"coupling_hist": encode_array(torch.histc(sw[K]["c"].float().cpu(), bins=50, min=0, max=1))}


def _unit_tracker(test, K):
    def track(epoch, model, history):   # accuracy and entropy at K after every epoch, on the test digits
        r = level_sweep(model, test, (K,))[K]
        history.setdefault("entropy", []).append(r["entropy"])
        history.setdefault("accuracy", []).append(r["accuracy"])
    return track


def unit_run(unit, device: torch.device, smoke: bool) -> dict:
    """Train the unit's networks (see the notes above the unit declarations) and measure them."""
    import os
    import time

    from .. import data, train

    cfg = unit.config
    cuda_speed_settings(device)
    splits = data.load(UNIT_SMOKE["dataset"] if smoke else cfg["dataset"], device=device, seed=cfg["split_seed"])
    tr, val, test = splits["train"], splits["val"], splits["test"]
    if smoke:
        tr, val, test = tr.subset(UNIT_SMOKE["train"], seed=unit.seed), val.subset(UNIT_SMOKE["val"]), test.subset(UNIT_SMOKE["test"])
    elif (len(tr), len(val), len(test)) != (cfg["train_images"], cfg["validation"], cfg["test_images"]):
        raise ValueError(f"{unit.key}: expected {cfg['train_images']:,} training, {cfg['validation']:,} validation and "
                         f"{cfg['test_images']:,} test digits; got {len(tr):,}, {len(val):,} and {len(test):,}")
    S = _unit_sizes(unit, smoke)
    epochs = UNIT_SMOKE["epochs"] if smoke else cfg["epochs"]
    steps = UNIT_SMOKE["search_steps"] if smoke else cfg["search_steps"]
    K, levels = cfg["levels"], tuple(cfg["levels_sweep"])
    fast = "static" if os.environ.get("CAPSBOOK_NO_GRAPH", "").strip() not in ("", "0") else True
    args = dict(epochs=epochs, batch_size=UNIT_SMOKE["batch_size"] if smoke else cfg["batch_size"], lr=cfg["lr"],
                lr_decay=cfg["lr_decay"], predict=predict_lengths, seed=unit.seed, amp=False, progress=True,
                eval_batch_size=cfg["eval_batch"], fast=fast)
    nets, metrics, arrays, hist = {}, {"epochs": epochs, "train_images": len(tr), "test_images": len(test)}, {}, {}

    def train_one(name, pruner=None, before=True, masks_for=None):
        t0 = time.perf_counter()
        net = make_capsnet(S, unit.seed, device)       # every network of a seed starts from the same weights
        params = prunable(net)
        if masks_for is not None:
            for (module, pname), mask in zip(params, masks_for(net, params)):
                set_mask(module, pname, mask)
        pr = pruner(params) if pruner is not None else None
        h = train.fit(net, tr, margin_loss_fn, before_step=pr.before_step if (pr is not None and before) else None,
                      on_epoch_end=chain(pr.on_epoch_end if pr is not None else None, _unit_tracker(test, K)),
                      desc=f"{unit.key} {name}", **args)
        m, a = unit_measure(net, test, levels, K)
        m.update(sparsity=sparsity(params) if (pr is not None or masks_for is not None) else 0.0,
                 train_seconds=time.perf_counter() - t0, step_path=h.get("step_path"),
                 step_path_reason=h.get("step_path_reason"),
                 images_per_s_median=float(np.median(h["images_per_s"])))
        if h.get("gate_active"):
            m["gate_active_mean"] = {k: float(np.mean([g[k] for g in h["gate_active"]])) for k in ("raw", "applied")}
        metrics[name] = m
        arrays.update({f"{name}:{k}": v for k, v in a.items()})
        hist[name] = {k: v for k, v in h.items() if isinstance(v, list)}
        nets[name] = net
        return h

    if cfg["kind"] == "vanilla":
        train_one("vanilla")
    else:
        rem_h = train_one("REM (LOBSTER)", lambda w: LobsterPruner(
            w, val, lam=cfg["lobster_lambda"], decay=cfg["lobster_decay"], tolerance=cfg["lobster_tolerance"],
            steps=steps, sensitivity=cfg["lobster_sensitivity"]))
        path = list(rem_h["sparsity"])
        # magnitude alone (its before_step does nothing without a shrinkage; the eager step keeps the
        # computation the chapter's), then the shrinkage without the gate, both to REM's sparsities
        train_one("MP", lambda w: MatchedPruner(w, path, lam=0.0))
        train_one(WEIGHT_DECAY, lambda w: MatchedPruner(w, path, lam=cfg["lobster_lambda"], decay=cfg["lobster_decay"],
                                                         sensitivity="none"))
        n_snip = UNIT_SMOKE["snip_batch"] if smoke else cfg["snip_batch"]
        train_one("SNIP", masks_for=lambda net, params: snip_masks(net, params, margin_loss_fn, tr.x[:n_snip],
                                                                   tr.y[:n_snip], path[-1]))
        metrics["rem_sparsity_by_epoch"] = path
    # the measured rate of the unit: training images over training seconds, epoch by epoch, every network
    return {"metrics": metrics, "history": {**hist, "images_per_s": [r for h in hist.values() for r in h["images_per_s"]]},
            "arrays": arrays}


def _register_units() -> None:
    from .units import Unit, register

    base = {**UNIT_SCHEDULE, "capsnet": UNIT_CAPSNET}
    E, n, val, test = base["epochs"], base["train_images"], base["validation"], base["test_images"]
    track = E * test                                     # K = 11 on the test digits after every epoch
    for s in UNIT_SEEDS:
        register(Unit("06", "vanilla", s, unit_run, {**base, "kind": "vanilla"}, unit_probe, "capsnet28-nodecoder",
                      E * n + track, 10 + 10 * s,
                      "DR-CapsNet without decoder: accuracy (float, +Q), parse-tree entropy and keys for K = 2..129"))
        # four trainings, LOBSTER's threshold search on the validation digits after each of REM's epochs,
        # and each network's tracking (forward passes counted as whole training images: a long projection)
        register(Unit("06", "pruned", s, unit_run, {**base, "kind": "pruned"}, unit_probe, "capsnet28-nodecoder",
                      4 * (E * n + track) + E * base["search_steps"] * val, 11 + 10 * s,
                      "REM, then MP and weight decay at REM's sparsities, then SNIP at its final one: entropy, "
                      "accuracy, sparsity, zero W_ij blocks, silenced capsules"))


_register_units()


def _declare_paper_scale() -> None:
    """REM's Table 1 numbers these units measure, at the units' K (the paper-scale column of the chapter's
    comparison table)."""
    from .units import paper_scale

    K = str(UNIT_SCHEDULE["levels"])
    rem = "REM (LOBSTER)"
    paper_scale("rem_acc_vanilla", "06/vanilla", lambda m: m["vanilla"]["float_accuracy"], ".2%")
    paper_scale("rem_acc_q", "06/vanilla", lambda m: m["vanilla"]["by_K"][K]["accuracy"], ".2%")
    paper_scale("rem_entropy_q", "06/vanilla", lambda m: m["vanilla"]["by_K"][K]["entropy"], ".2f")
    paper_scale("rem_acc_rem", "06/pruned", lambda m: m[rem]["by_K"][K]["accuracy"], ".2%")
    paper_scale("rem_entropy_rem", "06/pruned", lambda m: m[rem]["by_K"][K]["entropy"], ".2f")
    paper_scale("rem_sparsity", "06/pruned", lambda m: m[rem]["sparsity"], ".2%")


_declare_paper_scale()


# ----------------------------------------------------------------------------- the chapter's paper-scale views

UNIT_ROWS = (("vanilla (+Q)", "06/vanilla", "vanilla"), ("REM (LOBSTER)", "06/pruned", "REM (LOBSTER)"),
             (WEIGHT_DECAY, "06/pruned", WEIGHT_DECAY), ("MP", "06/pruned", "MP"), ("SNIP", "06/pruned", "SNIP"))


def unit_groups(smoke: bool = False):
    """The vanilla runs and the pruned runs (REM with its matched controls), each over its seeds."""
    from .units import group
    return [group("06/vanilla", "the unpruned DR-CapsNet", smoke),
            group("06/pruned", "REM with its controls at matched sparsity", smoke)]


def _runs(groups, prefix: str, name: str) -> dict:
    """``{seed: metrics of network name}`` of the group under ``prefix``."""
    g = next(g for g in groups if g.prefix == prefix)
    return {r["seed"]: r["metrics"][name] for r in g.results}



def unit_frame(groups, K: int = 11):
    """Every network at K levels: mean ± SD over the seeds run of the quantized accuracy, the entropy (and
    over its ceiling), keys per class, sparsity, the share of zero W_ij blocks and the silenced capsules,
    and the entropy's paired difference to REM."""
    import pandas as pd

    rem = _runs(groups, "06/pruned", "REM (LOBSTER)")
    rows = []
    for label, prefix, name in UNIT_ROWS:
        runs = _runs(groups, prefix, name)
        at = lambda k: [m["by_K"][str(K)][k] for m in runs.values()]   # noqa: E731
        both = sorted(set(runs) & set(rem))
        cells = [seed_spread(at("accuracy"), ".4f"), seed_spread(at("entropy"), ".2f"),
                 seed_spread([m["by_K"][str(K)]["entropy"] / m["by_K"][str(K)]["ceiling"] for m in runs.values()], ".2f"),
                 seed_spread(at("keys_mean"), ".0f"), seed_spread([m["sparsity"] for m in runs.values()], ".3f"),
                 seed_spread([m["zero_blocks"] for m in runs.values()], ".3f"),
                 seed_spread([m["silenced_capsules"] for m in runs.values()], ".0f"),
                 "–" if name == "REM (LOBSTER)" or not both else
                 seed_spread([runs[s]["by_K"][str(K)]["entropy"] - rem[s]["by_K"][str(K)]["entropy"] for s in both], "+.2f")]
        if not runs:
            cells = ["not yet run"] + ["–"] * 7
        rows.append((label, *cells, len(runs)))
    cols = ["accuracy (+Q)", "entropy H (bits)", "H / its ceiling", "keys per class", "sparsity",
            "zero blocks W_ij", "silenced capsules", "H minus REM's (same seed)", "seeds"]
    return pd.DataFrame(rows, columns=["network", *cols]).set_index("network")


def k_rule(levels, accuracy, tolerance: float) -> int:
    """The paper's choice of K: the smallest number of levels whose accuracy is within ``tolerance`` of
    the best over the sweep (where accuracy stops improving)."""
    best = max(accuracy)
    return next(k for k, a in zip(levels, accuracy) if a >= best - tolerance)


def draw_levels(groups):
    """Entropy (over its ceiling) and quantized accuracy against the number of levels K, mean over the
    seeds run of each network."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN

    fig, (ax_h, ax_a) = plt.subplots(2, 1, figsize=(COLUMN_IN, 5.8), sharex=True, layout="constrained")
    drawn = 0
    for i, (label, prefix, name) in enumerate(UNIT_ROWS):
        runs = list(_runs(groups, prefix, name).values())
        if not runs:
            continue
        ks = sorted(int(k) for k in runs[0]["by_K"])
        h = [np.mean([m["by_K"][str(k)]["entropy"] / m["by_K"][str(k)]["ceiling"] for m in runs]) for k in ks]
        a = [100 * np.mean([m["by_K"][str(k)]["accuracy"] for m in runs]) for k in ks]
        ax_h.plot(ks, h, "o-", ms=3, color=f"C{i}", label=f"{label} ({len(runs)} seed{'s' * (len(runs) > 1)})")
        ax_a.plot(ks, a, "o-", ms=3, color=f"C{i}")
        drawn += 1
    if not drawn:
        raise ValueError("draw_levels needs at least one result")
    for ax in (ax_h, ax_a):
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(UNIT_LEVELS, [str(k) for k in UNIT_LEVELS])
        ax.grid(alpha=0.3)
    ax_h.set_ylabel("$\\mathbb{H} \\,/\\, \\log_2 n_j$")
    ax_a.set_ylabel("test accuracy, quantized (%)")
    ax_a.set_xlabel("quantization levels $K$")
    fig.legend(*ax_h.get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=10)
    return fig


def draw_entropy_accuracy(groups):
    """Each network's path over the epochs in the plane of quantized test accuracy and entropy at
    K = 11 (first seed run): networks compared at matched accuracy, not at matched epoch."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN

    fig, ax = plt.subplots(figsize=(COLUMN_IN * 0.85, 3.8), layout="constrained")
    drawn = 0
    for i, (label, prefix, name) in enumerate(UNIT_ROWS):
        g = next(g for g in groups if g.prefix == prefix)
        if not g.results:
            continue
        res = sorted(g.results, key=lambda r: r["seed"])[0]
        h = res["history"][name]
        ax.plot(100 * np.array(h["accuracy"]), h["entropy"], "o-", ms=3, color=f"C{i}", label=f"{label}, seed {res['seed']}")
        drawn += 1
    if not drawn:
        raise ValueError("draw_entropy_accuracy needs at least one result")
    ax.set_xlabel("test accuracy, quantized, $K = 11$ (%)")
    ax.set_ylabel("entropy $\\mathbb{H}$ (bits), $K = 11$")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=10)
    return fig


def paper_scale_summary(groups, K: int) -> str:
    """One sentence on the unpruned network at paper scale: float and quantized accuracy, the K that
    the paper's rule picks (the smallest K whose quantized accuracy, mean over the seeds, is not below
    the float one), and the entropy at ``K`` against its ceiling."""
    from .stats import summarise

    runs = _runs(groups, "06/vanilla", "vanilla")
    if not runs:
        return "no paper-scale run of the unpruned network has been made yet, so this section says nothing about it"
    seeds = sorted(runs)

    def over(get):
        return summarise([get(runs[s]) for s in seeds], seeds)
    flt = over(lambda r: r["float_accuracy"])
    levels = sorted(int(k) for k in runs[seeds[0]]["by_K"])
    rule = next((k for k in levels if over(lambda r, k=k: r["by_K"][str(k)]["accuracy"]).mean >= flt.mean),
                max(levels))
    at = lambda key: over(lambda r: r["by_K"][str(K)][key])   # noqa: E731
    H, ceiling, share = at("entropy"), at("ceiling"), at("share_uniform_level")
    n = "one seed" if len(seeds) == 1 else f"mean of {len(seeds)} seeds"
    return (f"trained on all the training digits, the unpruned network reaches {flt.mean:.2%} test accuracy with "
            f"float couplings and {at('accuracy').mean:.2%} with couplings quantized to K = {K} levels ({n}); the "
            f"paper's rule for K (the fewest levels that lose no accuracy) picks K = {rule} here; and at K = {K} its parse-tree entropy is {H.mean:.2f} "
            f"bits, {H.mean / ceiling.mean:.0%} of the ceiling of {ceiling.mean:.2f} bits, with "
            f"{share.mean:.1%} of its couplings rounding to the level of 1/J")


# ----------------------------------------------------------------------------- a small world where couplings leave 1/J

WORLD_METHODS = ("vanilla", "REM (LOBSTER)", "MP", WEIGHT_DECAY)


def world_splits(S, seed: int = 0) -> dict:
    """Training, validation and test examples of the part-whole world at ``S``'s sizes, one set of
    frames (:func:`capslib.book.ch04.part_whole_world`): ``{"train", "val", "test"}`` as Splits."""
    from ..datasets import Split
    from .ch04 import part_whole_world

    kw = dict(parts=S.world_parts, wholes=S.world_wholes, dim=S.world_dim, noise=S.world_noise,
              pose_scale=S.world_scale)
    u, y, frames = part_whole_world(S.world_train, seed=seed, **kw)
    out = {"train": Split(u, y)}
    for k, name in enumerate(("val", "test"), start=1):
        u, y, _ = part_whole_world(getattr(S, f"world_{name}"), seed=seed + k, frames=frames, **kw)
        out[name] = Split(u, y)
    return out


@torch.no_grad()
def world_measure(net: nn.Module, test, levels: Sequence[int]) -> dict:
    """Accuracy, the couplings' mean row entropy over ``ln J``, the norm of the routed layer's weights
    as they act (pruned ones at zero) and, for each ``K``, the parse-tree entropy (plug-in and
    Miller-Madow, bits), keys and quantized accuracy of ``net`` on ``test``."""
    import math

    from ..pruning import effective_weight

    sweep = level_sweep(net, test, levels)
    _, _, c = last_couplings(net, test.x)
    row = float(-(c * c.clamp_min(1e-30).log()).sum(-1).mean()) / math.log(c.shape[-1])
    w = effective_weight(net.digit, "W") if hasattr(net.digit, "W_mask") else net.digit.W
    out = {"accuracy": sweep["float"]["accuracy"], "row_entropy": row, "weight_norm": float(w.norm())}
    for K in levels:
        out[K] = {k: sweep[K][k] for k in ("entropy", "entropy_mm", "keys", "accuracy")}
    return out


def world_compare(seed: int, S, splits: dict) -> dict:
    """Chapter 6's comparison in the part-whole world for one seed: a shared start of
    ``S.world_pretrain_epochs`` epochs, then vanilla, REM (LOBSTER with the MNIST run's gate and lambda),
    MP (magnitude pruning to REM's sparsity after each epoch) and weight decay (LOBSTER's shrinkage
    without its gate, at the same sparsities), each for the remaining epochs; the seed fixes the
    initial weights and the minibatch order. No checkpoints: a run takes about a second.

    Returns ``{method: world_measure(...) + {"sparsity"}}`` for the methods of :data:`WORLD_METHODS`."""
    import copy

    from .. import train as _train
    from ..pruning import sparsity as _sparsity

    kw = dict(batch_size=S.world_batch, lr=S.world_lr, seed=seed, progress=False, predict=predict_lengths)
    rest = S.world_epochs - S.world_pretrain_epochs
    from .ch04 import PartWholeCaps

    start = PartWholeCaps(S.world_parts, S.world_wholes, S.world_dim, seed=seed)
    _train.fit(start, splits["train"], margin_loss_fn, epochs=S.world_pretrain_epochs, **kw)
    out = {}

    def branch(method, pruner_for=None):
        net = copy.deepcopy(start)
        pruner = pruner_for(prunable(net)) if pruner_for else None
        hist = _train.fit(net, splits["train"], margin_loss_fn, epochs=rest,
                          before_step=getattr(pruner, "before_step", None),
                          on_epoch_end=getattr(pruner, "on_epoch_end", None), **kw)
        out[method] = world_measure(net, splits["test"], S.world_levels)
        out[method]["sparsity"] = _sparsity(pruner.params) if pruner else 0.0
        return hist

    branch(WORLD_METHODS[0])
    h = branch(WORLD_METHODS[1], lambda w: LobsterPruner(w, splits["val"], lam=S.world_lambda, decay=S.lobster_decay,
                                                          tolerance=S.world_tolerance, steps=S.world_search_steps,
                                                          sensitivity="max"))
    path = list(h.get("sparsity", [])) or [0.0]
    branch(WORLD_METHODS[2], lambda w: MatchedPruner(w, path, lam=0.0))
    branch(WORLD_METHODS[3], lambda w: MatchedPruner(w, path, lam=S.world_lambda, decay=S.lobster_decay,
                                                     sensitivity="none"))
    return out


# ----------------------------------------------------------------------------- the controls: pruning at matched sparsity, on a schedule, SNIP

class MatchedPruner(LobsterPruner):
    """Chapter 6's ablation at matched sparsity: an optional shrinkage step (:func:`lobster_step`
    with ``sensitivity``; ``lam = 0`` for none), and after each epoch global magnitude pruning to
    the next sparsity in ``targets`` (e.g. the sparsities REM reached after each of its epochs),
    whatever the loss says."""

    def __init__(self, params, targets: Sequence[float], lam: float = 0.0, decay: float = 0.99,
                 sensitivity: str | None = "none"):
        super().__init__(params, None, lam=lam, decay=decay, sensitivity=sensitivity)
        self.targets = list(targets)

    def before_step(self, model, optimizer) -> None:
        if self.lam > 0:
            super().before_step(model, optimizer)

    def on_epoch_end(self, epoch, model, history) -> None:
        self._record_gates(history)
        done = len(history.get("sparsity", []))
        apply_global_magnitude(self.params, self.targets[min(done, len(self.targets) - 1)])
        history.setdefault("sparsity", []).append(sparsity(self.params))
        self.lam = self.lam0 * self.decay ** (epoch + 1)


class MagnitudeSchedulePruner:
    """Plain iterative magnitude pruning (chapter 6): after epoch ``e`` of ``epochs``, prune
    globally by magnitude to ``final * (e + 1) / epochs`` sparsity, whatever the loss says."""

    def __init__(self, params, final: float, epochs: int, start_epoch: int = 0):
        if not 0.0 <= final < 1.0:
            raise ValueError(f"final must be in [0, 1); got {final}")
        self.params, self.final, self.epochs, self.start = params, final, epochs, start_epoch
        attach_masks(params)

    def target(self, epoch: int) -> float:
        done = min(epoch + 1 - self.start, self.epochs)
        return self.final * max(done, 0) / self.epochs

    def on_epoch_end(self, epoch, model, history) -> None:
        apply_global_magnitude(self.params, self.target(epoch))
        history.setdefault("sparsity", []).append(sparsity(self.params))


def snip_masks(model: nn.Module, params, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
               fraction: float) -> list[torch.Tensor]:
    """SNIP (Lee et al. 2019; chapter 6): connection sensitivity ``|dL/dw * w|`` on one
    batch at initialization; keep the ``1 - fraction`` most sensitive weights, globally."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1); got {fraction}")
    model.zero_grad(set_to_none=True)
    loss, _ = loss_fn(model, x, y)
    tensors = [_orig(m, n) for m, n in params]
    grads = torch.autograd.grad(loss, tensors)
    scores = [(g * w).abs().detach() for g, w in zip(grads, tensors)]
    flat = torch.cat([s.flatten() for s in scores])
    k = int(round(fraction * flat.numel()))
    if k == 0:
        return [torch.ones_like(s) for s in scores]
    threshold = torch.kthvalue(flat.float().cpu(), k).values.item()
    return [(s > threshold).to(s.dtype) for s in scores]
