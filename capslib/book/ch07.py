"""Chapter 7 (products of expert capsules): its name and its sizes per profile
(``capslib.book.profiles.settings(CHAPTER)``); the chapter's mathematics is in the library,
:mod:`capslib.poe`, and its model and trainings in :mod:`capslib.poe_models`."""
from __future__ import annotations

from . import profiles

CHAPTER = "07_products_of_expert_capsules"

# ci: CPU, embedded MNIST. full: the paper's Sec. 4.1 architecture (9x9x1x128 and
# 9x9x128x128 stride-2 filters, 576 capsules of 8D, 20 capsules of 16D) on full
# MNIST. The paper gives neither epochs nor learning rates ("about fifteen minutes
# on a single GPU"); the full schedule below is ours and says so in the chapter.
# `seeds`: how many draws of W and U (CD-1 and decoder stages) run on the one trained autoencoder.
# `control_*`, `sparsity_*`: the controls of the collapse (centring, shrinkage, a sparsity term): how many
# seeds and training capsules they use, and the sparsity term's weight and target firing probability (the
# uncentred run and the centred run with the sparsity term go over every seed). `label_shuffles`: how many
# shufflings of the labels give the chance level of the division of labour (:func:`division_of_labour`);
# `specialise_margin`: the margin of practical equivalence for a difference of two winner purities, declared
# before the runs of the chapter's controls. `sparsity_strong`: the sparsity term's weight in the run that asks
# whether pressing harder makes the experts fire for fewer digits (the centred run's seeds, its target);
# `concentrate_margin`: the margin of practical equivalence for the change of the most active capsule's share of a
# digit's firing (:func:`firing_pattern`) at that weight, declared before the run: 0.05 = 1 / out_caps, the share
# of one capsule when all fire equally.
profiles.register(
    CHAPTER,
    ci=dict(dataset="embedded", channels=32, kernel=9, capsule_dim=8, out_caps=20, out_dim=16,
            iterations=3, dropout=0.1, ae_epochs=1, ae_lr=3e-3, ae_batch=50, unsupervised_subset=2000,
            cd_epochs=3, cd_lr=0.05, cd_momentum=0.9, cd_decay=0.9, cd_l2=1e-4, cd_batch=50,
            dec_epochs=2, dec_lr=0.05, init_std=0.01, samples=4, purity_samples=20,
            seeds=3,
            control_subset=1000, control_seeds=3, sparsity_strength=100.0, sparsity_target=0.1, sparsity_strong=1000.0,
            label_shuffles=100, specialise_margin=0.1, concentrate_margin=0.05),
    full=dict(dataset="mnist", channels=128, kernel=9, capsule_dim=8, out_caps=20, out_dim=16,
              iterations=3, dropout=0.1, ae_epochs=20, ae_lr=1e-3, ae_batch=128, unsupervised_subset=None,
              cd_epochs=30, cd_lr=0.05, cd_momentum=0.9, cd_decay=0.95, cd_l2=1e-4, cd_batch=128,
              dec_epochs=30, dec_lr=0.05, init_std=0.01, samples=4, purity_samples=500,
              seeds=5,
              control_subset=None, control_seeds=5, sparsity_strength=100.0, sparsity_target=0.1, sparsity_strong=1000.0,
              label_shuffles=100, specialise_margin=0.1, concentrate_margin=0.05),
)


# ============================================================================= paper scale as experiment units
#
# Every training that chapter 7's paper-scale section rests on, as one unit per variant and seed (see
# :mod:`capslib.book.units`): ``07/experts/<variant>/s<k>``, Hauser's whole pipeline at the paper's sizes on
# MNIST (55,000 training digits, the 10,000 test digits), from one seed: the convolutional autoencoder
# (Adam on the pixels' squared error), W by CD-1 with mixing by dynamic routing (Algorithm 1), the decoder U
# (Sec. 4.1), then what the chapter measures on them. The variants differ only in what W's training sees:
#
# - ``hauser``: the input capsules as they come (the chapter's main run, where the experts collapse onto
#   the mean pattern);
# - ``centred``: the input capsules minus their mean over the training digits (U reconstructs the centred
#   capsules; the mean is added back before the transposed convolutions);
# - ``sparsity``: the input capsules as they come, with the sparsity term added to every CD-1 update;
# - ``both``: the centred input capsules with the sparsity term (in the chapter's controls the experts then divide the digits).
#
# Measured: the autoencoder's test error; the experts' firing probability and mean resultant length (the
# collapse); which experts are on for each digit (:func:`firing_pattern`); the division of labour (:func:`division_of_labour`: each training digit given to the expert that
# fires most for it); a linear read-out of the test labels from the 20 output capsules, from the input capsules, and
# from a random W of the trained W's norm; the reconstruction error through the capsules and U; generated
# images per capsule (restricted domain) and their class purity and distinct majority classes under a
# CapsNet classifier of chapter 2 trained inside the unit; the first samples per capsule as a figure.
#
# Schedule: UNIT_SCHEDULE's epochs are fewer than the `full` profile's (ae 20, CD-1 30, decoder 30) so
# that each unit projects within 8 minutes on one H100 at the conservative rate assumed for a network
# with no bench measurement: the CD-1 and decoder stages have none (the step bench timed the autoencoder).

import os

import numpy as np
import torch
import torch.nn.functional as F

from .. import data, models, poe, poe_models, train
from ..checks import check_positive_int, check_tensor
from ..ops import squash
from .units import Unit, built_in_float64, encode_array, register

_FULL = profiles.SIZES[CHAPTER]["full"]
UNIT_FAMILY = "poe-pipeline"
# ``version`` counts changes to what the units' ``run`` does that the probe cannot see (bump it with such
# a change: every chapter-7 result then reads stale).
UNIT_SCHEDULE = dict(version=3, dataset="mnist", split_seed=0, train_images=55_000,
                     ae_epochs=10, cd_epochs=15, dec_epochs=15, classifier_epochs=2,
                     full_epochs=dict(ae=_FULL["ae_epochs"], cd=_FULL["cd_epochs"], dec=_FULL["dec_epochs"]),
                     **{k: _FULL[k] for k in ("channels", "kernel", "capsule_dim", "out_caps", "out_dim", "iterations",
                                              "dropout", "ae_lr", "ae_batch", "cd_lr", "cd_momentum", "cd_decay",
                                              "cd_l2", "cd_batch", "dec_lr", "init_std", "purity_samples",
                                              "sparsity_strength", "sparsity_target", "label_shuffles")},
                     classifier=dict(conv_channels=256, primary_types=32, primary_dim=8, digit_dim=16,
                                     decoder=[512, 1024], iterations=3, batch_size=128, lr=1e-3),
                     readout_ridge=1e-2, shown_samples=6, chunk=1000,
                     precision="float32, TF32 products and convolutions")
UNIT_VARIANTS = ("hauser", "centred", "sparsity", "both")
CENTRED = ("centred", "both")
SPARSE = ("sparsity", "both")
UNIT_SEEDS = (0, 1, 2)
UNIT_SMOKE = dict(dataset="embedded", train=256, test=100, channels=8, ae_epochs=1, cd_epochs=1, dec_epochs=1,
                  classifier_epochs=1, purity_samples=10, shown_samples=2,
                  classifier=dict(conv_channels=8, primary_types=2, primary_dim=8, digit_dim=16, decoder=[32, 64],
                                  iterations=3, batch_size=32, lr=1e-3))


def _sizes(unit: Unit, smoke: bool) -> dict:
    cfg = {**unit.config, **({k: v for k, v in UNIT_SMOKE.items() if k in unit.config} if smoke else {})}
    return cfg


def _prepared(unit: Unit, X: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """What W's training sees of the input capsules ``X``: centred for the ``centred`` variant."""
    return X - mean if unit.config["variant"] in CENTRED else X


def _cd_kwargs(cfg: dict) -> dict:
    return dict(lr=cfg["cd_lr"], batch=cfg["cd_batch"], iterations=cfg["iterations"], momentum=cfg["cd_momentum"],
                decay=cfg["cd_decay"], l2=cfg["cd_l2"])


def unit_probe(unit: Unit) -> dict:
    """One update of each training at full size in float64 on the CPU (seed 0, four seeded random images):
    the autoencoder's loss and gradient norms (back-propagation), and the norms of the CD-1 update of W
    (with the unit's centring or sparsity term; the mean is the four images') and of the decoder's update of U."""
    cfg = unit.config
    torch.manual_seed(0)
    model = built_in_float64(lambda: poe_models.PoECapsules(
        channels=cfg["channels"], kernel=cfg["kernel"], capsule_dim=cfg["capsule_dim"], out_caps=cfg["out_caps"],
        out_dim=cfg["out_dim"], iterations=cfg["iterations"], dropout=cfg["dropout"], init_std=cfg["init_std"]))
    model.eval()   # dropout off
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 1, 28, 28, generator=g, dtype=torch.float64)
    loss = F.mse_loss(model.autoencoder(x), x)
    loss.backward()
    out = {"ae_loss": loss.item(), "x_sum": x.sum().item()}
    for name, p in model.autoencoder.named_parameters():
        out[f"grad:{name}"] = p.grad.norm().item()
    with torch.no_grad():
        X = model.capsules(x)
        Xv = _prepared(unit, X, X.mean(0))
        r = poe.cd1(model.W, Xv, cfg["iterations"])
        delta = r.delta
        if cfg["variant"] in SPARSE:
            delta = delta + cfg["sparsity_strength"] * poe.sparsity_term(model.W, Xv, r.c, cfg["sparsity_target"])
        out["delta_W"] = delta.norm().item()
        out["delta_U"] = poe.decoder_gradient(model.U, r.y, Xv, cfg["iterations"]).norm().item()
    return out


def _chunks(f, x: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([f(x[i:i + size]) for i in range(0, len(x), size)])


def decode_images(model, U: torch.Tensor, y: torch.Tensor, mean: torch.Tensor | None, iterations: int) -> torch.Tensor:
    """Output capsules -> images through U (plus the training mean of the input capsules where W saw them centred)."""
    x = poe.decode_capsules(U, y, iterations)
    if mean is not None:
        x = x + mean
    return model.autoencoder.decode(poe_models.capsules_to_code(x, model.code_shape))


@torch.no_grad()
def generate_restricted(model, U: torch.Tensor, hemispheres: torch.Tensor, g: torch.Tensor,
                        mean: torch.Tensor | None, iterations: int) -> torch.Tensor:
    """Hauser's generated images (Sec. 4.2, Fig. 2), restricted domain, for every output capsule: each draw of
    ``g (N, Do)`` flipped into the half-sphere around the capsule's mean training output (``hemispheres (J, Do)``),
    squashed into that capsule alone, routed down through ``U`` (plus the training mean of the input capsules
    where ``W`` saw them centred) and decoded. Returns ``(J, N, 1, 28, 28)``."""
    J, Do = hemispheres.shape
    images = []
    for j in range(J):
        gj = torch.where((g @ hemispheres[j] < 0).unsqueeze(1), -g, g)
        y = g.new_zeros(g.shape[0], J, Do)
        y[:, j] = squash(gj)
        images.append(decode_images(model, U, y, mean, iterations))
    return torch.stack(images)


def readout_correct(f_train, y_train, f_test, y_test, ridge: float = 1e-2) -> torch.Tensor:
    """Which test rows a one-vs-all least-squares read-out of the ten labels (ridge ``ridge``, with a bias
    column, in float64) fitted on ``(f_train, y_train)`` gets right: a boolean ``(len(f_test),)``."""
    A = torch.cat([f_train, torch.ones(len(f_train), 1, device=f_train.device)], 1).double()
    T = F.one_hot(y_train, 10).double()
    Wr = torch.linalg.solve(A.T @ A + ridge * torch.eye(A.shape[1], dtype=A.dtype, device=A.device), A.T @ T)
    At = torch.cat([f_test, torch.ones(len(f_test), 1, device=f_test.device)], 1).double()
    return (At @ Wr).argmax(1) == y_test


def _readout(f_train, y_train, f_test, y_test, ridge: float) -> float:
    """Test accuracy of :func:`readout_correct`."""
    return float(readout_correct(f_train, y_train, f_test, y_test, ridge).double().mean())


def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    return (x.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def unit_run(unit: Unit, device: torch.device, smoke: bool) -> dict:
    """Train the unit's pipeline (see the notes above) and measure it."""
    cfg = _sizes(unit, smoke)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    splits = data.load(UNIT_SMOKE["dataset"] if smoke else cfg["dataset"], device=device, seed=cfg["split_seed"])
    tr, test = splits["train"], splits["test"]
    if smoke:
        tr, test = tr.subset(UNIT_SMOKE["train"]), test.subset(UNIT_SMOKE["test"])
    elif len(tr) != cfg["train_images"]:
        raise ValueError(f"{unit.key}: expected {cfg['train_images']:,} training digits; got {len(tr):,}")
    T, chunk = cfg["iterations"], cfg["chunk"]
    torch.manual_seed(unit.seed)
    model = poe_models.PoECapsules(channels=cfg["channels"], kernel=cfg["kernel"], capsule_dim=cfg["capsule_dim"],
                                   out_caps=cfg["out_caps"], out_dim=cfg["out_dim"], iterations=T,
                                   dropout=cfg["dropout"], init_std=cfg["init_std"]).to(device)
    ae = model.autoencoder
    # the autoencoder: Adam on the squared pixel error, minibatches of a permutation seeded by the unit's seed
    opt = torch.optim.Adam(ae.parameters(), lr=cfg["ae_lr"])
    gen = torch.Generator().manual_seed(unit.seed)
    history: dict = {"ae_test_mse": []}
    for _ in range(cfg["ae_epochs"]):
        ae.train()
        perm = torch.randperm(len(tr), generator=gen).to(device)
        for k in range(0, len(tr), cfg["ae_batch"]):
            xb = tr.x[perm[k:k + cfg["ae_batch"]]]
            loss = F.mse_loss(ae(xb), xb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        ae.eval()
        with torch.no_grad():
            history["ae_test_mse"].append(float(_chunks(lambda b: ((ae(b) - b) ** 2).flatten(1).mean(1), test.x,
                                                        chunk).mean()))
    metrics = {"autoencoder_test_mse": history["ae_test_mse"][-1],
               "mean_image_mse": float(((tr.x.mean(0, keepdim=True) - test.x) ** 2).mean()),
               "train_images": len(tr), "test_images": len(test)}
    with torch.no_grad():
        X_tr, X_te = _chunks(model.capsules, tr.x, chunk), _chunks(model.capsules, test.x, chunk)
    mean = X_tr.mean(0)
    Xv_tr, Xv_te = _prepared(unit, X_tr, mean), _prepared(unit, X_te, mean)
    # W by CD-1 (Algorithm 1), drawn from the unit's seed, minibatches of a permutation seeded by it
    gW = torch.Generator().manual_seed(unit.seed)
    W = (cfg["init_std"] * torch.randn(model.W.shape, generator=gW)).to(device)
    U = (cfg["init_std"] * torch.randn(model.U.shape, generator=gW)).to(device)
    sparsity = (cfg["sparsity_strength"], cfg["sparsity_target"]) if cfg["variant"] in SPARSE else None
    cd = poe_models.train_weights(W, Xv_tr, epochs=cfg["cd_epochs"], generator=torch.Generator().manual_seed(unit.seed),
                                  sparsity=sparsity, **_cd_kwargs(cfg))
    history.update({f"cd_{k}": v for k, v in cd.items()})

    @torch.no_grad()
    def encode(Wm, X):
        return _chunks(lambda b: squash(poe.route_forward(Wm, b, poe.cosine_routing(poe.votes(Wm, b), T))), X, chunk)

    Y_tr, Y_te = encode(W, Xv_tr), encode(W, Xv_te)
    lengths = Y_tr.norm(dim=-1)
    directions = Y_tr / lengths.unsqueeze(-1).clamp_min(1e-12)
    resultant = directions.mean(0).norm(dim=-1)                              # (J,)
    Wr = torch.randn(W.shape, generator=torch.Generator().manual_seed(10_000 + unit.seed)).to(device)
    Wr *= W.norm() / Wr.norm()
    ridge = cfg["readout_ridge"]
    metrics["collapse"] = {"firing_mean": float(lengths.mean()), "firing_per_capsule": lengths.mean(0).tolist(),
                           "resultant_min": float(resultant.min()), "resultant_mean": float(resultant.mean()),
                           "resultant_per_capsule": resultant.tolist(), "weight_norm": float(W.norm())}
    labour = division_of_labour(lengths, tr.y, shuffles=cfg["label_shuffles"])
    metrics["division"] = {k: v for k, v in labour.items() if k != "winner"}
    metrics["firing_pattern"] = firing_pattern(lengths)
    metrics["readout"] = {
        "capsules": _readout(Y_tr.flatten(1), tr.y, Y_te.flatten(1), test.y, ridge),
        "random_W": _readout(encode(Wr, Xv_tr).flatten(1), tr.y, encode(Wr, Xv_te).flatten(1), test.y, ridge),
        "input_capsules": _readout(X_tr.flatten(1), tr.y, X_te.flatten(1), test.y, ridge)}
    # the decoder U (Sec. 4.1) on the pairs (input capsules as W saw them, output capsules)
    offset = mean if unit.config["variant"] in CENTRED else None
    dec = poe_models.train_decoder(U, Y_tr, Xv_tr, epochs=cfg["dec_epochs"],
                                   generator=torch.Generator().manual_seed(unit.seed), **_cd_kwargs(cfg) | {"lr": cfg["dec_lr"]})
    history.update({f"dec_{k}": v for k, v in dec.items()})
    with torch.no_grad():
        rec = _chunks(lambda idx: ((decode_images(model, U, Y_te[idx], offset, T) - test.x[idx]) ** 2).flatten(1).mean(1),
                      torch.arange(len(test), device=device), chunk)
    metrics["reconstruction_mse"] = float(rec.mean())
    # generated images per capsule, restricted domain (g flipped into the half-sphere of the capsule's mean output)
    n = cfg["purity_samples"]
    g = torch.randn(n, cfg["out_dim"], generator=torch.Generator().manual_seed(unit.seed)).to(device)
    images = generate_restricted(model, U, Y_tr.mean(0), g, offset, T)     # (J, n, 1, 28, 28)
    # the classifier: chapter 2's CapsNet, trained here
    cc = UNIT_SMOKE["classifier"] if smoke else cfg["classifier"]
    torch.manual_seed(unit.seed)
    clf = models.CapsNet(conv_channels=cc["conv_channels"], primary_types=cc["primary_types"],
                         primary_dim=cc["primary_dim"], digit_dim=cc["digit_dim"], decoder=tuple(cc["decoder"]),
                         iterations=cc["iterations"]).to(device)

    def clf_step(m, x, y):
        out = m(x, y)
        return models.capsnet_loss(out, x, y), out.lengths

    ch = train.fit(clf, tr, clf_step, epochs=cfg["classifier_epochs"], batch_size=cc["batch_size"], lr=cc["lr"],
                   seed=unit.seed, amp=False, progress=True, desc=f"{unit.key} classifier",
                   fast="static" if os.environ.get("CAPSBOOK_NO_GRAPH", "").strip() not in ("", "0") else True)
    metrics["classifier_test_accuracy"] = train.evaluate(clf, test, batch_size=chunk)
    metrics["classifier_step_path"] = ch.get("step_path")
    with torch.no_grad():
        clf.eval()
        pred = _chunks(lambda b: clf(b).lengths.argmax(1), images.flatten(0, 1), chunk).view(cfg["out_caps"], n)
    counts = F.one_hot(pred, 10).sum(1)                                      # (J, 10)
    per_capsule = counts.max(1).values.double() / n
    rnd = torch.randint(0, 10, (20000, n), generator=torch.Generator().manual_seed(0))
    majority = counts.argmax(1)
    metrics["purity"] = {"mean": float(per_capsule.mean()), "per_capsule": per_capsule.tolist(),
                         "majority": majority.tolist(), "distinct_classes": len(set(majority.tolist())),
                         "samples_per_capsule": n,
                         "chance": float((F.one_hot(rnd, 10).sum(1).max(1).values.double() / n).mean()),
                         "mean_intensity": float(images.mean())}
    shown = cfg["shown_samples"]
    arrays = {"samples": encode_array(_to_uint8(images[:, :shown, 0]), "uint8"),
              "majority": encode_array(majority, "int64")}
    return {"metrics": metrics, "history": history, "arrays": arrays}


_WHAT = {"hauser": "the input capsules as they come", "centred": "centred input capsules",
         "sparsity": "the input capsules with the sparsity term",
         "both": "the centred input capsules with the sparsity term"}


def division_of_labour(lengths: torch.Tensor, labels: torch.Tensor, shuffles: int = 100, seed: int = 0) -> dict:
    """How the experts divide the images: each image goes to the expert that fires most for it (the longest of
    its output capsules, ``lengths (N, J)``), and the images an expert wins are read by their ``labels (N,)``,
    which play no part in training. Returns ``winner (N,)``; ``experts``, how many experts win at least one
    image; ``purity``, the share of the images whose label is the most common one among their expert's images
    (the purity of the partition; 1 when every expert wins one class only); ``shuffled``, the same purity with
    the labels shuffled against the partition (mean over ``shuffles`` permutations): what the partition's
    sizes alone give; and ``majority``, each expert's most common label (-1 for an expert that wins nothing)."""
    if lengths.dim() != 2 or labels.shape != lengths.shape[:1]:
        raise ValueError(f"lengths must be (N, J) and labels (N,); got {tuple(lengths.shape)} and {tuple(labels.shape)}")
    if not (isinstance(shuffles, int) and shuffles >= 1):
        raise ValueError(f"shuffles must be an int >= 1; got {shuffles!r}")
    J = lengths.shape[1]
    winner = lengths.argmax(1).cpu()
    labels = labels.cpu()

    def counts(y):
        return torch.bincount(winner * 10 + y, minlength=J * 10).view(J, 10)

    c = counts(labels)
    g = torch.Generator().manual_seed(seed)
    shuffled = [counts(labels[torch.randperm(len(labels), generator=g)]).max(1).values.sum().item() / len(labels)
                for _ in range(shuffles)]
    return {"winner": winner, "experts": int((c.sum(1) > 0).sum()), "purity": c.max(1).values.sum().item() / len(labels),
            "shuffled": float(np.mean(shuffled)),
            "majority": torch.where(c.sum(1) > 0, c.argmax(1), torch.full((J,), -1)).tolist()}


def firing_pattern(lengths: torch.Tensor) -> dict:
    """Which experts are *on* for each image: capsule ``j`` is on when its firing probability, the length
    ``lengths (N, J)`` of its output, exceeds 1/2 (on more likely than off). Returns ``on``, the share of the
    (image, capsule) pairs that are on; ``one_on``, the share of the images with exactly one capsule on (what a
    generated code of Hauser's Fig. 2 is: one capsule set to squash(g), the others to 0); ``winner_share``, the
    mean over the images of the longest capsule's share of the summed lengths (1 / J for equal lengths, 1 for
    one capsule alone); ``runner_up``, the mean ratio of the second longest length to the longest."""
    if lengths.dim() != 2 or lengths.shape[1] < 2:
        raise ValueError(f"lengths must be (N, J) with J >= 2; got {tuple(lengths.shape)}")
    if bool((lengths < 0).any()) or not bool(torch.isfinite(lengths).all()):
        raise ValueError("lengths must be finite and non-negative")
    on = lengths > 0.5
    top = lengths.topk(2, dim=1).values
    return {"on": float(on.double().mean()), "one_on": float((on.sum(1) == 1).double().mean()),
            "winner_share": float((top[:, 0] / lengths.sum(1).clamp_min(1e-12)).double().mean()),
            "runner_up": float((top[:, 1] / top[:, 0].clamp_min(1e-12)).double().mean())}


def _register() -> None:
    s = UNIT_SCHEDULE
    images = (s["ae_epochs"] + s["cd_epochs"] + s["dec_epochs"] + s["classifier_epochs"]) * s["train_images"]
    for k, variant in enumerate(UNIT_VARIANTS):
        for seed in UNIT_SEEDS:
            register(Unit("07", f"experts/{variant}", seed, unit_run, {**UNIT_SCHEDULE, "variant": variant}, unit_probe,
                          UNIT_FAMILY, images, 10 + 10 * seed + k,
                          f"Hauser's pipeline, W trained on {_WHAT[variant]}: collapse, read-out, generated "
                          "digits' classes"))


_register()


def _declare_paper_scale() -> None:
    """The rows of the chapter's comparison table that the units measure: Hauser's recipe (the chapter's main
    run) for the autoencoder's and the capsules' reconstructions, the run with both changes for the experts'
    division of the digits."""
    from .units import paper_scale

    paper_scale("autoencoder test MSE", "07/experts/hauser", lambda m: m["autoencoder_test_mse"], ".4f", row=True)
    paper_scale("image MSE through PoE capsules and U", "07/experts/hauser", lambda m: m["reconstruction_mse"], ".4f",
                row=True)
    paper_scale("experts divide the training digits (centred inputs, sparsity term)", "07/experts/both",
                lambda m: m["division"]["purity"], ".2f", row=True, what="winner purity")


_declare_paper_scale()


# ----------------------------------------------------------------------------- the chapter's paper-scale views

VARIANT_LABELS = {"hauser": "as printed (uncentred)", "centred": "centred inputs", "sparsity": "sparsity term",
                  "both": "centred + sparsity"}


def experts_groups(smoke: bool = False):
    from .units import group
    names = {"hauser": "W trained on the input capsules as they come", "centred": "W trained on centred input capsules",
             "sparsity": "W trained with the sparsity term",
             "both": "W trained on centred input capsules with the sparsity term"}
    return [group(f"07/experts/{v}", names[v], smoke) for v in UNIT_VARIANTS]


def experts_frame(groups):
    """One row per variant: mean ± SD over the seeds run of what the chapter measures."""
    import pandas as pd

    def cell(g, f, digits=3):
        v = [f(r["metrics"]) for r in g.results]
        if not v:
            return "not yet run"
        return f"{np.mean(v):.{digits}f}" if len(v) == 1 else f"{np.mean(v):.{digits}f} ± {np.std(v, ddof=1):.{digits}f}"

    rows = {}
    for v, g in zip(UNIT_VARIANTS, groups):
        rows[VARIANT_LABELS[v]] = {
            "firing probability": cell(g, lambda m: m["collapse"]["firing_mean"]),
            "mean resultant length (lowest capsule)": cell(g, lambda m: m["collapse"]["resultant_min"]),
            "experts that win digits": cell(g, lambda m: m["division"]["experts"], 1),
            "winner purity": cell(g, lambda m: m["division"]["purity"]),
            "winner purity, labels shuffled": cell(g, lambda m: m["division"]["shuffled"]),
            "digits with one expert on": cell(g, lambda m: m["firing_pattern"]["one_on"]),
            "winner's share of the firing": cell(g, lambda m: m["firing_pattern"]["winner_share"]),
            "read-out accuracy": cell(g, lambda m: m["readout"]["capsules"]),
            "read-out, random W": cell(g, lambda m: m["readout"]["random_W"]),
            "class purity": cell(g, lambda m: m["purity"]["mean"]),
            "distinct classes": cell(g, lambda m: m["purity"]["distinct_classes"], 1),
            "image MSE through U": cell(g, lambda m: m["reconstruction_mse"], 4),
            "seeds": len(g.results)}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("inputs of the CD-1 training")


def draw_samples(result: dict):
    """Generated images of every output capsule $j$ alone (restricted domain), one column per capsule,
    headed by the class the classifier gives most of that capsule's samples."""
    import matplotlib.pyplot as plt

    from .units import decode_array
    from .viz import COLUMN_IN

    s = decode_array(result["arrays"]["samples"])            # (J, n, 28, 28)
    majority = decode_array(result["arrays"]["majority"])
    J, n, h, w = s.shape
    canvas = np.ones((n * (h + 2), J * (w + 2)))
    for j in range(J):
        for k in range(n):
            canvas[k * (h + 2):k * (h + 2) + h, j * (w + 2):j * (w + 2) + w] = 1 - s[j, k] / 255.0
    fig, ax = plt.subplots(figsize=(COLUMN_IN, COLUMN_IN * n * (h + 2) / (J * (w + 2)) + 0.7))
    ax.imshow(canvas, cmap="gray", vmin=0, vmax=1)
    ax.set_xticks([(j + 0.5) * (w + 2) for j in range(J)])
    ax.set_xticklabels([str(int(c)) for c in majority], fontsize=8)
    ax.set_yticks([])
    ax.set_xlabel("output capsule $j$, headed by its majority class", fontsize=10)
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    fig.tight_layout()
    return fig


def draw_purity(groups):
    """Class purity per capsule, every seed of every variant as a dot, against chance."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN

    if not any(g.results for g in groups):
        raise ValueError("draw_purity needs at least one result")
    fig, ax = plt.subplots(figsize=(COLUMN_IN * 0.8, 3.0))
    chance = None
    for k, (v, g) in enumerate(zip(UNIT_VARIANTS, groups)):
        for r in g.results:
            p = r["metrics"]["purity"]["per_capsule"]
            ax.plot(k + np.linspace(-0.2, 0.2, len(p)), p, "o", ms=3, alpha=0.6, color=f"C{k}")
            chance = r["metrics"]["purity"]["chance"]
    if chance is not None:
        ax.axhline(chance, color="k", ls=":", lw=1, label="random labels")
        ax.legend(fontsize=9, frameon=False)
    ax.set_xticks(range(len(UNIT_VARIANTS)))
    ax.set_xticklabels([VARIANT_LABELS[v] for v in UNIT_VARIANTS], fontsize=9)
    ax.set_ylabel("class purity of capsule $j$", fontsize=11)
    ax.set_ylim(0, 1.02)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- CD-1 against the exact gradient on a toy whose states are enumerated

def _check_states(W: torch.Tensor, states: torch.Tensor, data: torch.Tensor) -> None:
    poe._check_x(W, states, "states")
    check_tensor("data", data, dims=1, floating=True, shape_doc="(S,)")
    if len(data) != len(states):
        raise ValueError(f"data must hold one weight per state ({len(states)}); got {len(data)}")
    if (data < 0).any() or abs(float(data.sum()) - 1.0) > 1e-6:
        raise ValueError("data must be a probability vector over the states (non-negative, summing to 1)")


def exact_log_likelihood_gradient(W: torch.Tensor, states: torch.Tensor, data: torch.Tensor, iterations: int = 3,
                                  normalize: str = "outputs", through_couplings: bool = False) -> torch.Tensor:
    """Exact ``d/dW sum_s data_s log P(states_s)`` on a finite state space (chapter 7's enumerable toy).

    The model is Hauser's Eq. 10 restricted to the ``S`` listed configurations of the input capsules:
    ``P(x) = exp(-F(x)) / Z`` with ``Z = sum_s exp(-F(states_s))`` summed exactly, and the couplings of
    each configuration found by cosine routing on it, ``c = c(x, W)``.

    Args:
        W: ``(I, J, Do, Di)``; states: every configuration ``(S, I, Di)``; data: the data distribution
            over the states ``(S,)`` (non-negative, sums to 1).
        through_couplings: ``False`` holds each ``c`` constant (the gradient Eq. 18 describes, with its
            model term computed exactly); ``True`` also differentiates through the routing.

    Returns:
        the ascent direction, shape of ``W``.
    """
    poe._check_w(W)
    _check_states(W, states, data)
    check_positive_int("iterations", iterations)
    poe._check_normalize(normalize)
    with torch.enable_grad():
        Wg = W.detach().clone().requires_grad_(True)
        u = poe.votes(Wg, states)
        c = poe._routing_differentiable(u, iterations, normalize)
        if not through_couplings:
            c = c.detach()
        z = torch.einsum("bij,bijo->bjo", c, u)
        neg_f = torch.log1p((z * z).sum(-1)).sum(1)                      # -F(x) for every state
        log_p = neg_f - torch.logsumexp(neg_f, 0)
        (grad,) = torch.autograd.grad((data * log_p).sum(), Wg)
    return grad


def gibbs_cd1_expected(W: torch.Tensor, states: torch.Tensor, data: torch.Tensor, iterations: int = 3,
                       normalize: str = "outputs") -> torch.Tensor:
    """The expected CD-1 update with a true Gibbs step on a finite state space (chapter 7's enumerable toy).

    ``h ~ P(h | x) = prod_j p_j^h_j (1 - p_j)^(1 - h_j)`` (Eq. 12), then ``x' ~ P(x' | h)`` proportional to
    ``exp(-E(x', h)) = prod_j ||z_j(x')||^(2 h_j)`` (Eq. 7) over the listed states, each with its own
    couplings ``c(x', W)``; the update is ``E_data[d(x)] - E[d(x')]`` with ``d`` the per-sample data term of
    Eq. 18. Expectations over ``x``, ``h`` and ``x'`` are summed exactly (``2^J`` states of ``h``).

    Returns:
        the expected ascent direction, shape of ``W``.
    """
    poe._check_w(W)
    _check_states(W, states, data)
    check_positive_int("iterations", iterations)
    poe._check_normalize(normalize)
    J = W.shape[1]
    with torch.no_grad():
        c = poe.cosine_routing(poe.votes(W, states), iterations, normalize)          # (S, I, J)
        z = poe.route_forward(W, states, c)                                       # (S, J, Do)
        n2 = (z * z).sum(-1)                                                  # (S, J)
        p = n2 / (1.0 + n2)
        g = z / (1.0 + n2).unsqueeze(-1)
        d = 2.0 * torch.einsum("sij,sjo,sie->sijoe", c, g, states)            # per-state data term
        hs = torch.tensor([[(k >> j) & 1 for j in range(J)] for k in range(2 ** J)], dtype=W.dtype,
                          device=W.device)                                     # (H, J)
        p_h_given_x = torch.prod(hs * p.unsqueeze(1) + (1 - hs) * (1 - p.unsqueeze(1)), dim=-1)   # (S, H)
        log_w = hs @ torch.log(n2.clamp_min(1e-300)).T                        # (H, S): log exp(-E(x', h))
        p_x_given_h = torch.softmax(log_w, dim=1)                             # (H, S)
        weight_model = (data @ p_h_given_x) @ p_x_given_h                     # (S,) marginal of x'
        return torch.einsum("s,sijoe->ijoe", data - weight_model, d)
