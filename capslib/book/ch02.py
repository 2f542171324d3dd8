"""Chapter 2's experiment units (Sabour et al. 2017 at paper scale).

- ``02/main/s<k>``: the paper's CapsNet (3 routing iterations, reconstruction loss) trained on 55,000
  MNIST digits with the paper's augmentation (shifts of up to 2 px each way, zero padding); test
  error on the 10,000 test digits, and what the chapter's figures need: couplings on test digits,
  reconstructions, the per-dimension perturbation grid, the misclassified digits. It is also the
  "3 iterations, reconstruction" cell of Table 1.
- ``02/table1/<cell>/s<k>``: the other CapsNet cells of Table 1 (1 or 3 iterations, with or without
  the reconstruction loss), same data, schedule and augmentation.
- ``02/baseline/s<k>``: Sabour's baseline CNN (three 5x5 convolutions of 256, 256, 128 channels,
  fully connected 328 and 192, dropout, softmax), same data, schedule and augmentation.
- ``02/multimnist/s<k>``: the paper's CapsNet on MultiMNIST (two digits of different classes on a 36x36
  canvas, each shifted by up to 4 px): pairs of the 55,000 training digits whose positions are drawn anew
  every time a pair is seen (:class:`capslib.multimnist.PairShift`); both-labels-right accuracy and the
  segmentation share on test pairs of the test digits, with the reconstructions of a few of them.
"""
from __future__ import annotations

import copy
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import data, models, multimnist, train
from . import paper
from ..checks import check_positive_int
from ..ops import margin_loss
from .units import Unit, built_in_float64, cuda_speed_settings, encode_array, register, step_summary

FULL_TRAIN = 55_000
SEEDS = (0, 1, 2)
# The schedule of every chapter-2 unit: the book's full recipe (Adam, exponential decay per epoch),
# paper-length training, the paper's shift augmentation; float32 with TF32 matrix products on a GPU
# (measured faster than bf16 autocast for this network, 2026-11).
# ``version`` counts changes to what ``run`` or ``capslib.train.fit`` do that the probe cannot see
# (bump it with such a change: every chapter-2 result then reads stale).
SCHEDULE = dict(version=2, dataset="mnist", split_seed=0, validation=5000, train_images=55_000, epochs=50,
                batch_size=128, lr=1e-3, lr_decay=0.96, max_shift=2, optimizer="Adam",
                precision="float32 weights and activations, TF32 products and convolutions",
                eval_batch=1000, coupling_digits=2000,
                step="fit's fast path: whole batches only (the last partial batch of each epoch dropped), "
                     "fused Adam, the step captured in a CUDA graph where the capture works")
CAPSNET = dict(conv_channels=256, primary_types=32, primary_dim=8, digit_dim=16, decoder=[512, 1024])
# Smoke runs (CPU tests, rehearsals): the same code on the embedded digits, tiny widths, one epoch.
SMOKE = dict(dataset="embedded", epochs=1, batch_size=32, train=256, test=200,
             capsnet=dict(conv_channels=8, primary_types=2, primary_dim=8, digit_dim=16, decoder=[32, 64]),
             cnn=dict(widths=(8, 8, 4), hidden=(16, 12)))
TABLE1_CELLS = {"r1-norecon": (1, False), "r1-recon": (1, True), "r3-norecon": (3, False)}


class BaselineCNN(nn.Module):
    """Sabour et al.'s baseline (Sec. 5): three 5x5 stride-1 convolutions (256, 256, 128 channels,
    'same' padding, ReLU), fully connected layers of 328 and 192 (ReLU), dropout, a 10-way linear
    layer scored by softmax cross-entropy. At these sizes it has 35.4M parameters, as the paper says."""

    def __init__(self, widths=(256, 256, 128), hidden=(328, 192), image_size: int = 28, num_classes: int = 10,
                 dropout: float = 0.5):
        super().__init__()
        layers, c = [], 1
        for w in widths:
            layers += [nn.Conv2d(c, w, 5, padding=2), nn.ReLU(inplace=True)]
            c = w
        self.features = nn.Sequential(*layers)
        sizes = [c * image_size * image_size, *hidden]
        head: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(sizes[:-1], sizes[1:]):
            head += [nn.Linear(a, b), nn.ReLU(inplace=True)]
        head += [nn.Dropout(dropout), nn.Linear(sizes[-1], num_classes)]
        self.head = nn.Sequential(*head)

    def forward(self, x):
        return self.head(self.features(x))

    @classmethod
    def scaled(cls, conv_scale: float, **kw) -> "BaselineCNN":
        """The baseline beside a CapsNet whose convolutions are ``conv_scale`` times the paper's (chapter 2's
        ablation at ``ci``): the three convolutions scaled alike (at least one channel each), the fully
        connected layers kept at the paper's 328 and 192."""
        if not conv_scale > 0:
            raise ValueError(f"conv_scale must be > 0; got {conv_scale}")
        return cls(widths=tuple(max(1, round(w * conv_scale)) for w in (256, 256, 128)), **kw)


def _recon_weight() -> float:
    return paper.value("sabour_recon_weight")


def capsnet_step(recon_weight: float):
    """The training loss of a CapsNet cell: margin loss plus, when ``recon_weight`` > 0, the weighted
    reconstruction loss (without it the decoder is not run)."""
    def step(model, x, y):
        if recon_weight > 0:
            out = model(x, y)
            return models.capsnet_loss(out, x, y, recon_weight=recon_weight), out.lengths
        v, _ = model.encode(x)
        lengths = v.norm(dim=-1)
        return margin_loss(lengths.to(torch.promote_types(lengths.dtype, torch.float32)), y), lengths
    return step


def cnn_step(model, x, y):
    scores = model(x)
    return F.cross_entropy(scores.to(torch.promote_types(scores.dtype, torch.float32)), y), scores.detach()


def build(unit: Unit, smoke: bool = False) -> nn.Module:
    cfg = unit.config
    if cfg["model"] == "cnn":
        return BaselineCNN(**SMOKE["cnn"]) if smoke else BaselineCNN()
    sizes = SMOKE["capsnet"] if smoke else cfg["capsnet"]
    return models.CapsNet(conv_channels=sizes["conv_channels"], primary_types=sizes["primary_types"],
                          primary_dim=sizes["primary_dim"], digit_dim=sizes["digit_dim"],
                          decoder=tuple(sizes["decoder"]), iterations=cfg["iterations"])


def step(unit: Unit):
    cfg = unit.config
    return cnn_step if cfg["model"] == "cnn" else capsnet_step(_recon_weight() if cfg["recon"] else 0.0)


def probe(unit: Unit) -> dict:
    """One training step of the unit's network at full size in float64 on the CPU (seed 0, four
    seeded random images, the unit's augmentation and loss, dropout off): loss and per-parameter
    gradient norms."""
    torch.manual_seed(0)
    net = built_in_float64(lambda: build(unit, smoke=False))
    net.eval()   # dropout off (its masks come from CPU-specific generators); its rate is in the code's config
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 3, 7, 9])
    x = data.RandomShift(unit.config["max_shift"], seed=0)(x)
    loss, _ = step(unit)(net, x, y)
    loss.backward()
    return step_summary(loss, x, net)


def coupling_entropy_bits(c: torch.Tensor) -> torch.Tensor:
    """Entropy in bits of each input capsule's couplings ``c (B, I, J)`` over its parents: ``(B, I)``;
    ``log2 J`` for uniform couplings, 0 for one-hot ones."""
    c = c.clamp_min(1e-12)
    return -(c * c.log2()).sum(-1)


def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    return (x.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


@torch.no_grad()
def _capsnet_arrays(net: models.CapsNet, test: data.Split, n_couplings: int) -> tuple[dict, dict]:
    """Coupling statistics on test digits, reconstructions, the perturbation grid, misclassified digits."""
    net.eval()
    metrics, arrays = {}, {}
    x = test.x[:n_couplings]
    out = net(x)
    c = out.couplings.float()                                   # (B, I, J)
    J = c.shape[-1]
    pred = out.lengths.argmax(dim=1)
    ent = coupling_entropy_bits(c)                              # (B, I)
    arrays["coupling_hist"] = encode_array(torch.histc(c, bins=50, min=0, max=1))
    arrays["coupling_entropy_hist"] = encode_array(torch.histc(ent, bins=50, min=0, max=math.log2(J)))
    to_pred = c.gather(2, pred[:, None, None].expand(-1, c.shape[1], 1)).squeeze(-1)   # (B, I)
    metrics["coupling"] = {
        "digits": int(len(x)), "parents": J, "uniform": 1 / J, "uniform_entropy_bits": math.log2(J),
        "mean_entropy_bits": float(ent.mean()), "mean_max": float(c.max(-1).values.mean()),
        "mean_to_predicted": float(to_pred.mean()), "max_to_predicted": float(to_pred.max()),
        "fraction_max_above_half": float((c.max(-1).values > 0.5).float().mean()),
    }
    # two test digits of each class and their reconstructions (from the longest capsule)
    idx = torch.cat([(test.y == k).nonzero()[:2, 0] for k in range(net.num_classes)])
    o = net(test.x[idx])
    arrays["recon_labels"] = encode_array(test.y[idx], "int64")
    arrays["recon_predicted"] = encode_array(o.lengths.argmax(1), "int64")
    arrays["recon_input"] = encode_array(_to_uint8(test.x[idx, 0]), "uint8")
    arrays["recon_output"] = encode_array(_to_uint8(o.reconstruction[:, 0]), "uint8")
    # perturbation grid (Fig. 4): every dimension of the first test digit's class capsule moved by
    # the paper's steps over the paper's range
    step, top = paper.value("sabour_perturb_step"), paper.value("sabour_perturb_range")
    offsets = torch.arange(-round(top / step), round(top / step) + 1, device=x.device) * step
    v, _ = net.encode(test.x[:1])
    label = v.norm(dim=-1).argmax(1)
    D = v.shape[-1]
    grid = v.repeat(D * len(offsets), 1, 1)                     # (D*K, J, D)
    rows = torch.arange(D, device=x.device).repeat_interleave(len(offsets))
    grid[torch.arange(len(grid)), label.item(), rows] += offsets.repeat(D).to(grid.dtype)
    img = net.decode(grid, label.expand(len(grid)))
    arrays["perturb_offsets"] = encode_array(offsets)
    arrays["perturb_grid"] = encode_array(_to_uint8(img[:, 0]).view(D, len(offsets), *img.shape[-2:]), "uint8")
    arrays["perturb_label"] = encode_array(label, "int64")
    return metrics, arrays


def _fast_path():
    """``fit``'s fast path for a unit: the captured CUDA graph, or the static step alone when
    ``CAPSBOOK_NO_GRAPH`` is set (the fast check found the graph wrong or slow on this GPU)."""
    return "static" if os.environ.get("CAPSBOOK_NO_GRAPH", "").strip() not in ("", "0") else True


def run(unit: Unit, device: torch.device, smoke: bool) -> dict:
    """Train the unit's network (see the module's docstring) and measure it."""
    cfg = unit.config
    cuda_speed_settings(device)
    splits = data.load(SMOKE["dataset"] if smoke else cfg["dataset"], device=device, seed=cfg["split_seed"])
    tr, val, test = splits["train"], splits["val"], splits["test"]
    epochs = SMOKE["epochs"] if smoke else cfg["epochs"]
    batch = SMOKE["batch_size"] if smoke else cfg["batch_size"]
    if smoke:
        tr, test = tr.subset(SMOKE["train"], seed=unit.seed), test.subset(SMOKE["test"])
    elif (len(tr), len(val)) != (cfg["train_images"], cfg["validation"]):
        raise ValueError(f"{unit.key}: expected {cfg['train_images']:,} training and {cfg['validation']:,} validation "
                         f"digits; got {len(tr):,} and {len(val):,} (a smoke setting in the environment?)")
    torch.manual_seed(unit.seed)
    net = build(unit, smoke).to(device)
    best = {"val": -1.0, "epoch": 0, "state": None}

    def keep_best(epoch, model, history):  # the weights of the best validation epoch, kept in memory
        if history["val_acc"][-1] > best["val"]:
            best.update(val=history["val_acc"][-1], epoch=epoch + 1,
                        state=copy.deepcopy({k: t.detach().clone() for k, t in model.state_dict().items()}))

    history = train.fit(net, tr, step(unit), epochs=epochs, batch_size=batch, lr=cfg["lr"],
                        lr_decay=cfg["lr_decay"], val=val, seed=unit.seed, amp=False, progress=True,
                        augment=data.RandomShift(cfg["max_shift"], seed=unit.seed), on_epoch_end=keep_best,
                        eval_batch_size=cfg["eval_batch"], desc=unit.key,
                        fast=_fast_path())
    final = train.evaluate(net, test, batch_size=cfg["eval_batch"])
    with torch.no_grad():
        net.eval()
        preds = torch.cat([train.scores_of(net(test.x[i:i + 1000])).argmax(1) for i in range(0, len(test), 1000)])
        wrong = (preds != test.y).nonzero()[:, 0]
        wrong_idx = wrong[:100]
    metrics = {
        "test_accuracy": final, "test_error": 1 - final, "test_images": len(test),
        "test_errors": int(len(wrong)),
        "final_val_accuracy": history["val_acc"][-1], "epochs": epochs, "train_images": len(tr),
        "params": models.count_parameters(net),
        "images_per_s_median": float(np.median(history["images_per_s"])),
        "seconds_per_epoch_median": train.seconds_per_epoch(history),
        "step_path": history.get("step_path"), "step_path_reason": history.get("step_path_reason"),
    }
    arrays = {"wrong_index": encode_array(wrong_idx, "int64"), "wrong_predicted": encode_array(preds[wrong_idx], "int64"),
              "wrong_label": encode_array(test.y[wrong_idx], "int64")}
    final_state = {k: t.detach().clone() for k, t in net.state_dict().items()}
    if best["state"] is not None:
        net.load_state_dict(best["state"])
        metrics["best_val_epoch"] = best["epoch"]
        metrics["best_val_accuracy"] = best["val"]
        metrics["test_accuracy_at_best_val"] = train.evaluate(net, test, batch_size=cfg["eval_batch"])
        net.load_state_dict(final_state)
    if cfg["model"] == "capsnet" and cfg["recon"]:
        m, a = _capsnet_arrays(net, test, n_couplings=min(cfg["coupling_digits"], len(test)))
        metrics.update(m)
        arrays.update(a)
    elif cfg["model"] == "capsnet":
        with torch.no_grad():
            net.eval()
            _, c = net.encode(test.x[:min(cfg["coupling_digits"], len(test))])
            c = c.float()
            ent = coupling_entropy_bits(c)
            metrics["coupling"] = {"mean_entropy_bits": float(ent.mean()), "uniform_entropy_bits": math.log2(c.shape[-1]),
                                   "mean_max": float(c.max(-1).values.mean())}
    hist = {k: v for k, v in history.items() if isinstance(v, list)}
    return {"metrics": metrics, "history": hist, "arrays": arrays}


# ----------------------------------------------------------------------------- MultiMNIST at paper scale
#
# The paper trained on 60M pairs (each training digit overlaid on 1,000 others) for its 5.2 % error; a unit
# has minutes of one GPU, so it sees ``pairs`` pairings of the training digits for ``epochs`` epochs, each
# pair's two digits moved anew every time it is seen (:class:`capslib.multimnist.PairShift`): about 2.8M pair
# presentations. The network is the paper's CapsNet at 36x36, the loss the margin loss with both classes
# present plus the reconstruction of each digit from its own capsule. Test pairs come from the test digits.
# No rate has been measured for this network on a GPU: it is projected at the 40x40 CapsNet's bench rate
# (``capsnet40``, the nearest network measured), which errs on the long side for a 36x36 canvas but not for
# the second reconstruction the loss makes.
MULTIMNIST = dict(version=1, dataset="mnist", split_seed=0, validation=5000, train_images=55_000, canvas=multimnist.SIZE,
                  shift=multimnist.SHIFT, pairs=200_000, test_pairs=10_000, epochs=14, batch_size=128, lr=1e-3,
                  lr_decay=0.96, eval_batch=500, shown_pairs=8,
                  precision="float32 weights and activations, TF32 products and convolutions",
                  step="fit's fast path: whole batches only, fused Adam, the step captured in a CUDA graph where "
                       "the capture works")
MULTIMNIST_SMOKE = dict(dataset="embedded", epochs=1, pairs=256, test_pairs=100, batch_size=32)
MULTIMNIST_FAMILY = "capsnet40"


def build_multimnist(unit: Unit, smoke: bool = False) -> models.CapsNet:
    sizes = SMOKE["capsnet"] if smoke else unit.config["capsnet"]
    return models.CapsNet(image_size=unit.config["canvas"], conv_channels=sizes["conv_channels"],
                          primary_types=sizes["primary_types"], primary_dim=sizes["primary_dim"],
                          digit_dim=sizes["digit_dim"], decoder=tuple(sizes["decoder"]),
                          iterations=unit.config["iterations"])


def multimnist_step(model, x, y):
    return multimnist.loss(model, x, y, recon_weight=_recon_weight())


def probe_multimnist(unit: Unit) -> dict:
    """One training step of the MultiMNIST network at full size in float64 on the CPU: four seeded
    random pairs of centred 'digits', moved by the unit's :class:`capslib.multimnist.PairShift` (seed 0),
    its loss; loss and per-parameter gradient norms."""
    torch.manual_seed(0)
    net = built_in_float64(lambda: build_multimnist(unit, smoke=False))
    g = torch.Generator().manual_seed(0)
    S, inner = unit.config["canvas"], unit.config["canvas"] - 2 * unit.config["shift"]
    digits = torch.zeros(4, 2, S, S, dtype=torch.float64)
    lo = unit.config["shift"]
    digits[:, :, lo:lo + inner, lo:lo + inner] = torch.rand(4, 2, inner, inner, generator=g, dtype=torch.float64)
    x = torch.cat([torch.maximum(digits[:, :1], digits[:, 1:]), digits], dim=1)
    x = multimnist.PairShift(unit.config["shift"], seed=0)(x)
    y = torch.tensor([1, 23, 45, 98])
    loss, _ = multimnist_step(net, x, y)
    loss.backward()
    return step_summary(loss, x, net)


def run_multimnist(unit: Unit, device: torch.device, smoke: bool) -> dict:
    """Train the paper's CapsNet on MultiMNIST (see the notes above) and measure it."""
    cfg = unit.config
    cuda_speed_settings(device)
    splits = data.load(MULTIMNIST_SMOKE["dataset"] if smoke else cfg["dataset"], device=device, seed=cfg["split_seed"])
    tr, test = splits["train"], splits["test"]
    if not smoke and len(tr) != cfg["train_images"]:
        raise ValueError(f"{unit.key}: expected {cfg['train_images']:,} training digits; got {len(tr):,}")
    size = MULTIMNIST_SMOKE if smoke else cfg
    # centred pairings; PairShift moves each digit anew in every batch
    pairs = multimnist.generate(tr, size["pairs"], seed=unit.seed, shift=0, size=cfg["canvas"])
    test_pairs = multimnist.generate(test, size["test_pairs"], seed=10_000 + unit.seed, shift=cfg["shift"],
                                     size=cfg["canvas"])
    torch.manual_seed(unit.seed)
    net = build_multimnist(unit, smoke).to(device)
    epochs = size["epochs"]
    history = train.fit(net, pairs, multimnist_step, epochs=epochs, batch_size=size["batch_size"], lr=cfg["lr"],
                        lr_decay=cfg["lr_decay"], seed=unit.seed, amp=False, progress=True,
                        augment=multimnist.PairShift(cfg["shift"], seed=unit.seed), desc=unit.key,
                        fast=_fast_path())
    acc = multimnist.accuracy(net, test_pairs, batch_size=cfg["eval_batch"])
    seg = multimnist.segmentation(net, test_pairs, batch_size=cfg["eval_batch"])
    rec_err = reconstruction_error(net, test_pairs, batch_size=cfg["eval_batch"])
    k = min(cfg["shown_pairs"], len(test_pairs))
    with torch.no_grad():
        net.eval()
        xs, ys = test_pairs.x[:k], test_pairs.y[:k]
        v, _ = net.encode(multimnist.overlay(xs))
        ab = multimnist.labels(ys)
        recs = torch.stack([net.decode(v, ab[:, j])[:, 0] for j in range(2)], dim=1)   # (k, 2, S, S)
        top2 = v.norm(dim=-1).topk(2, dim=1).indices
    metrics = {"test_accuracy": acc, "test_error": 1 - acc, "segmentation": seg,
               "reconstruction_error": rec_err, "test_pairs": len(test_pairs),
               "train_pairs": len(pairs), "epochs": epochs, "pair_presentations": epochs * len(pairs),
               "params": models.count_parameters(net),
               "images_per_s_median": float(np.median(history["images_per_s"])),
               "seconds_per_epoch_median": train.seconds_per_epoch(history),
               "step_path": history.get("step_path"), "step_path_reason": history.get("step_path_reason")}
    arrays = {"shown_input": encode_array(_to_uint8(xs[:, 0]), "uint8"),
              "shown_digits": encode_array(_to_uint8(xs[:, 1:3]), "uint8"),
              "shown_reconstructions": encode_array(_to_uint8(recs), "uint8"),
              "shown_labels": encode_array(ab, "int64"), "shown_top2": encode_array(top2, "int64")}
    hist = {k_: v_ for k_, v_ in history.items() if isinstance(v_, list)}
    return {"metrics": metrics, "history": hist, "arrays": arrays}


def _images(epochs: int) -> int:
    return epochs * FULL_TRAIN


def _register() -> None:
    base = {**SCHEDULE}
    main_cfg = {**base, "model": "capsnet", "iterations": 3, "recon": True, "capsnet": CAPSNET}
    for s in SEEDS:
        register(Unit("02", "main", s, run, main_cfg, probe, "capsnet28", _images(base["epochs"]), 10 + s,
                      "the paper's CapsNet with shifts, paper length: test error; couplings, reconstructions"))
    for s in SEEDS:
        register(Unit("02", "baseline", s, run, {**base, "model": "cnn"}, probe, "cnn28", _images(base["epochs"]),
                      20 + 10 * s, "Sabour's baseline CNN (35.4M parameters), same schedule and shifts"))
    for i, (cell, (iters, recon)) in enumerate(TABLE1_CELLS.items()):
        for s in SEEDS:
            register(Unit("02", f"table1/{cell}", s, run,
                          {**base, "model": "capsnet", "iterations": iters, "recon": recon, "capsnet": CAPSNET},
                          probe, "capsnet28", _images(base["epochs"]), 30 + 10 * s + i,
                          f"Table 1 cell: {iters} routing iteration{'s' * (iters > 1)}, "
                          f"reconstruction {'on' if recon else 'off'}"))
    mm_cfg = {**MULTIMNIST, "capsnet": CAPSNET, "iterations": 3}
    for s in SEEDS:
        register(Unit("02", "multimnist", s, run_multimnist, mm_cfg, probe_multimnist, MULTIMNIST_FAMILY,
                      MULTIMNIST["epochs"] * MULTIMNIST["pairs"], 60 + 10 * s,
                      "MultiMNIST: the paper's CapsNet on overlapping pairs; both labels right, segmentation"))


_register()


# ----------------------------------------------------------------------------- the chapter's paper-scale views

# Table 1 of Sabour et al. as this book's units: row label, unit prefix, key of the paper's number
TABLE1 = (
    ("baseline CNN", "02/baseline", "sabour_baseline_error"),
    ("1 iteration, no reconstruction", "02/table1/r1-norecon", "sabour_r1_norecon_error"),
    ("1 iteration, reconstruction", "02/table1/r1-recon", "sabour_r1_recon_error"),
    ("3 iterations, no reconstruction", "02/table1/r3-norecon", "sabour_r3_norecon_error"),
    ("3 iterations, reconstruction", "02/main", "sabour_mnist_error"),
)


def _declare_paper_scale() -> None:
    """The paper's numbers these units measure (the paper-scale column of the chapter's comparison table)."""
    from .units import paper_scale

    for _, prefix, key in TABLE1:
        paper_scale(key, prefix, lambda m: m["test_error"], ".2%")
    paper_scale("sabour_multimnist_error", "02/multimnist", lambda m: m["test_error"], ".1%")


_declare_paper_scale()


def table1_groups(smoke: bool = False):
    from .units import group
    return [group(prefix, label, smoke) for label, prefix, _ in TABLE1]


def table1_frame(groups):
    """Table 1 beside the paper: test error in per cent, mean and SD over the seeds run (each seed
    one unit; n = how many), with the paper's number."""
    import pandas as pd

    rows = []
    for (label, _, key), g in zip(TABLE1, groups):
        errs = [100 * e for e in g.values("test_error")]
        n = len(errs)
        book = ("not yet run" if n == 0 else f"{np.mean(errs):.2f}" if n == 1 else
                f"{np.mean(errs):.2f} ± {np.std(errs, ddof=1):.2f} (SD)")
        rows.append((label, paper.text(key, pm=True), book, n))
    return pd.DataFrame(rows, columns=["network", "paper: test error (± SD over its trials)", "this book: test error (%)", "seeds"]
                        ).set_index("network")


def _grid(ax, images, nrow, ncol, title=None):
    h, w = images.shape[-2:]
    canvas = np.ones((nrow * (h + 2), ncol * (w + 2)))
    for i, im in enumerate(images[: nrow * ncol]):
        r, c = divmod(i, ncol)
        canvas[r * (h + 2):r * (h + 2) + h, c * (w + 2):c * (w + 2) + w] = 1 - im / 255.0
    ax.imshow(canvas, cmap="gray", vmin=0, vmax=1)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=11)


def draw_reconstructions(result: dict):
    """Test digits (top of each pair of rows) and the decoder's reconstructions from the longest class
    capsule (below), from a ``02/main`` result."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN
    from .units import decode_array

    a = result["arrays"]
    x, r = decode_array(a["recon_input"]), decode_array(a["recon_output"])
    n = len(x)
    pairs = np.concatenate([np.stack([x[i:i + 10], r[i:i + 10]]).reshape(-1, *x.shape[1:]) for i in range(0, n, 10)])
    fig, ax = plt.subplots(figsize=(COLUMN_IN * 0.9, COLUMN_IN * 0.9 * (2 * math.ceil(n / 10)) / 10 + 0.4))
    _grid(ax, pairs, 2 * math.ceil(n / 10), 10, "test digits (rows 1, 3) and their reconstructions (rows 2, 4)")
    fig.tight_layout()
    return fig


def draw_perturbations(result: dict):
    """Sabour's Fig. 4 from a ``02/main`` result: each row one of the 16 dimensions of the class
    capsule moved over the paper's range, the decoder's image at each step."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN
    from .units import decode_array

    a = result["arrays"]
    g, off = decode_array(a["perturb_grid"]), decode_array(a["perturb_offsets"])
    D, K = g.shape[:2]
    fig, ax = plt.subplots(figsize=(COLUMN_IN * 0.75, COLUMN_IN * 0.75 * D / K + 0.6))
    _grid(ax, g.reshape(D * K, *g.shape[2:]), D, K)
    ax.set_xticks([(k + 0.5) * (g.shape[-1] + 2) for k in (0, K // 2, K - 1)])
    ax.set_xticklabels([f"{off[k]:+.2f}" for k in (0, K // 2, K - 1)], fontsize=10)
    ax.set_yticks([(d + 0.5) * (g.shape[-2] + 2) for d in range(0, D, 3)])
    ax.set_yticklabels([f"$d={d + 1}$" for d in range(0, D, 3)], fontsize=10)
    ax.set_xlabel("change added to one dimension of $\\mathbf{v}_j$", fontsize=11)
    fig.tight_layout()
    return fig


def draw_couplings(results: list):
    """The couplings $c_{ij}$ on test digits after routing, one line per seed: histogram of their
    values, against the uniform $1/J$ they start from."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN
    from .units import decode_array

    if not results:
        raise ValueError("draw_couplings needs at least one result of the main unit")
    fig, ax = plt.subplots(figsize=(COLUMN_IN * 0.8, 3.2))
    for res in results:
        h = decode_array(res["arrays"]["coupling_hist"]).astype(float)
        edges = np.linspace(0, 1, len(h) + 1)
        ax.step(edges[:-1], h / h.sum(), where="post", label=f"seed {res['seed']}")
    J = results[0]["metrics"]["coupling"]["parents"]
    ax.axvline(1 / J, color="k", ls=":", lw=1, label="$1/J$")
    ax.set_yscale("log")
    ax.set_xlabel("coupling coefficient $c_{ij}$", fontsize=11)
    ax.set_ylabel("fraction of couplings", fontsize=11)
    ax.tick_params(labelsize=10)
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, frameon=False)
    fig.tight_layout()
    return fig


def paper_scale_summary(results: list) -> str:
    """One sentence on the paper-scale network's results (each a seed of ``02/main``): its test error
    beside the paper's, and how far its trained couplings moved from the uniform $1/J$ they start at."""
    if not results:
        return ("no paper-scale run of the paper's network has been made yet, so this section says "
                "nothing about its error or its couplings")
    err = float(np.mean([r["metrics"]["test_error"] for r in results]))
    cp = [r["metrics"]["coupling"] for r in results]
    H = float(np.mean([c["mean_entropy_bits"] for c in cp]))
    Hmax = cp[0]["uniform_entropy_bits"]
    mx = float(np.mean([c["mean_max"] for c in cp]))
    half = float(np.mean([c["fraction_max_above_half"] for c in cp]))
    n, epochs = len(results), results[0]["metrics"]["epochs"]
    seeds = "one seed" if n == 1 else f"mean of {n} seeds"
    moved = "stay close to uniform" if H / Hmax > 0.95 else "move well away from uniform"
    return (f"after {epochs} epochs the paper's network misclassifies {err:.2%} of the "
            f"{int(results[0]['metrics']['test_images']):,} test digits ({seeds}; the paper: "
            f"{paper.text('sabour_mnist_error')}), and its couplings {moved}: over "
            f"{cp[0]['digits']:,} test digits a row of couplings has a mean entropy of {H:.4f} bits, "
            f"{H / Hmax:.2%} of the {Hmax:.4f} bits of uniform couplings; the largest coupling of a row "
            f"averages {mx:.3f} against 1/J = {1 / cp[0]['parents']:.3f}, and {half:.2%} of the rows "
            f"give more than half of their vote to one parent")


# ----------------------------------------------------------------------------- MultiMNIST views

def multimnist_groups(smoke: bool = False):
    from .units import group
    return [group("02/multimnist", "MultiMNIST", smoke)]


def multimnist_summary(results: list) -> str:
    """One sentence on the MultiMNIST units' results beside the paper's error."""
    if not results:
        return "no paper-scale MultiMNIST run has been made yet"
    m = [r["metrics"] for r in results]
    err = float(np.mean([x["test_error"] for x in m]))
    seg = float(np.mean([x["segmentation"] for x in m]))
    rec = float(np.mean([x["reconstruction_error"] for x in m]))
    n = len(m)
    return (f"after {m[0]['pair_presentations']:,} pair presentations the paper's network gets at least one of the two "
            f"digits wrong on {err:.2%} of {m[0]['test_pairs']:,} test pairs ({'one seed' if n == 1 else f'mean of {n} seeds'}; "
            f"the paper: {paper.text('sabour_multimnist_error')} after far longer training), and the reconstruction "
            f"from a digit's own capsule is nearer to that digit than to the other one for {seg:.1%} of the digits, "
            f"with a squared error of {rec:.0%} of the digit's own sum of squared pixels")


def reconstruction_error(model, split: data.Split, batch_size: int = 500) -> float:
    """MultiMNIST's segmentation drawings, how blurred: the mean over every digit of every pair of its reconstruction's
    squared error over its own sum of squared pixels (:func:`capslib.multimnist.reconstruction_distances`): 0 for
    exact drawings, 1 for empty ones."""
    own, _, energy = multimnist.reconstruction_distances(model, split, batch_size)
    if bool((energy <= 0).any()):
        raise ValueError("a digit of the split has no ink: its reconstruction error has no scale")
    return float((own / energy).double().mean())


def downsample(split: data.Split, factor: int) -> data.Split:
    """``split``'s images averaged down by ``factor`` (each pixel the mean of a ``factor`` x ``factor``
    block; ``factor = 1`` returns the split itself): chapter 2 runs MultiMNIST at ``ci`` on 14-px digits,
    the paper's geometry at half scale."""
    if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
        raise ValueError(f"factor must be an int >= 1; got {factor!r}")
    if factor == 1:
        return split
    if split.x.shape[-1] % factor or split.x.shape[-2] % factor:
        raise ValueError(f"factor {factor} must divide the image size {tuple(split.x.shape[-2:])}")
    return data.Split(F.avg_pool2d(split.x, factor), split.y)


def draw_pairs(inputs, digits, reconstructions, labels, top2, title: str):
    """MultiMNIST pairs as Sabour's Fig. 5 draws them: each pair's input (top), its two digits (the first magenta,
    the second green, white where they overlap: a pair that red-green colour blindness leaves apart) and the two
    reconstructions, each from its own class capsule, one row each (the first's in magenta, the second's in green);
    headed "labels → two longest capsules". Arrays in [0, 1]: ``inputs (k, S, S)``, ``digits`` and
    ``reconstructions (k, 2, S, S)``; ``labels`` and ``top2 (k, 2)``."""
    import matplotlib.pyplot as plt

    def rgb(pair):
        return np.stack([pair[0], pair[1], pair[0]], axis=-1).clip(0, 1)     # magenta (red + blue) and green

    k = len(inputs)
    fig, axes = plt.subplots(4, k, figsize=(1.15 * k, 5.6), squeeze=False)
    for i in range(k):
        axes[0, i].imshow(inputs[i], cmap="gray", vmin=0, vmax=1)
        axes[0, i].set_title(f"{labels[i][0]}+{labels[i][1]} → {top2[i][0]},{top2[i][1]}", fontsize=10)
        axes[1, i].imshow(rgb(digits[i]))
        none = np.zeros_like(reconstructions[i][0])
        axes[2, i].imshow(rgb([reconstructions[i][0], none]))
        axes[3, i].imshow(rgb([none, reconstructions[i][1]]))
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    for row, name in enumerate(["input", "the two\ndigits", "first\nrebuilt", "second\nrebuilt"]):
        axes[row, 0].set_ylabel(name, fontsize=10)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def draw_multimnist(result: dict):
    """:func:`draw_pairs` of a ``02/multimnist`` result's test pairs."""
    from .units import decode_array

    a = result["arrays"]
    x, d, r = (decode_array(a[k]) / 255.0 for k in ("shown_input", "shown_digits", "shown_reconstructions"))
    return draw_pairs(x, d, r, decode_array(a["shown_labels"]), decode_array(a["shown_top2"]),
                      "MultiMNIST test pairs at paper scale: labels → two longest capsules")


# ----------------------------------------------------------------------------- the pitfalls' measurements

def noise_parent_length(inputs: int, parents: int, dim: int, vote_std: float) -> float:
    """Predicted length of a parent of uniform couplings fed only by independent random votes
    ``N(0, vote_std^2 I_dim)``: ``m / (1 + m)`` with ``m = E||s_j||^2 = vote_std^2 * inputs * dim /
    parents^2`` (the squash applied to the mean squared length of ``s_j = (1/J) sum_i u_hat_{j|i}``)."""
    for name, v in [("inputs", inputs), ("parents", parents), ("dim", dim)]:
        check_positive_int(name, v)
    if not (isinstance(vote_std, (int, float)) and vote_std > 0 and math.isfinite(vote_std)):
        raise ValueError(f"vote_std must be a positive number; got {vote_std!r}")
    m = vote_std ** 2 * inputs * dim / parents ** 2
    return m / (1 + m)


def nonfinite_count(t: torch.Tensor | None) -> int:
    """Number of NaN or infinite entries of a tensor (0 for None, e.g. a parameter without a gradient)."""
    if t is None:
        return 0
    return int((~torch.isfinite(t)).sum())
