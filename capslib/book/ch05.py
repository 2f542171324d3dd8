"""Chapter 5 (EM routing): its sizes per profile (``capslib.book.profiles.settings("05_em_routing")``); the chapter's
mathematics lives in the library: EM routing and the spread loss in :mod:`capslib.em`, the matrix-capsule
layers and networks in :mod:`capslib.em_layers`."""
from __future__ import annotations

import math as _math
import os

import numpy as np
import torch
from torch import nn

from .. import data, em, em_layers, train
from ..checks import check_positive_int, check_tensor
from ..em import FINAL_LAMBDA, NORMALIZE
from ..em_layers import W_INIT_STD
from . import profiles
from .units import Unit, built_in_float64, cuda_speed_settings, encode_array, register, step_summary

# A small world for the iteration study (the same at every profile): one class-capsule layer, routed by EM, on
# synthetic poses. Each example is an object of one of world_classes classes with a random pose O (an in-plane
# rotation and a translation); each of its world_parts parts t has the pose O P_tk^-1 for fixed part transforms P_tk
# of its class k, plus Gaussian noise world_noise, and a share world_outliers of the parts is replaced by random poses
# (clutter). A learned W_tk = P_tk makes the true class's votes agree. world_train / world_test examples, world_epochs
# epochs of Adam at world_lr in batches of world_batch, W starting at identity + world_init_std * noise, seeds
# sess.seed + k for k < world_seeds, both inverse-temperature schedules (constant at kappa_final = 1 on the normalised
# cost; the authors' on the unnormalised cost).
#
# The same world seen from new viewpoints (turn_*): objects turned by at most turn_familiar degrees either way in
# training (a third of the circle, as the paper trains on a third of smallNORB's azimuths), then the same test objects
# turned by each of turn_angles degrees (either way at random). The EM layer (turn_iterations iterations, constant
# schedule) against a two-layer perceptron of width turn_mlp_width on the flattened part poses, which stops at its
# first epoch (of at most turn_mlp_epochs, Adam at turn_mlp_lr) whose accuracy on turn_val familiar validation
# objects reaches the EM layer's (the paper's matched-accuracy protocol; its best epoch if none does). turn_far: the
# angle the verdicts read (not a quarter or half turn, which leave EM's cost unchanged by construction), turn_margin:
# the margin of practical equivalence of the accuracy lost there (set after prototype runs of these seeds; every
# verdict of the page is the same for any margin from 0.01 to 0.8); turn_seeds seeds sess.seed + k.
WORLD = dict(world_classes=5, world_parts=8, world_outliers=0.3, world_noise=0.05, world_train=2000, world_test=1000,
             world_epochs=5, world_lr=1e-2, world_batch=32, world_init_std=0.5, world_seeds=3,
             turn_familiar=60, turn_angles=(0, 30, 60, 90, 120, 150, 180), turn_far=150, turn_iterations=2,
             turn_val=500, turn_mlp_width=64, turn_mlp_epochs=20, turn_mlp_lr=3e-3, turn_margin=0.05, turn_seeds=5)

profiles.register(
    "05_em_routing",
    # CPU, embedded MNIST (28x28): a tiny network (A = 16, B = C = D = 4) trained on all 4000
    # embedded images for 3 epochs. The 1/2/3-iteration comparison trains the same network
    # (compare_sizes = A, B, C, D) for compare_epochs epoch(s) on compare_subset images in batches of
    # compare_batch_size, once per seed sess.seed + k, k < compare_seeds (its 9 trainings take about 35 s
    # on 2 cores). Its sizes were chosen in trial runs at seeds 0-2 (2026-11-28) as the cheapest of those
    # tried whose every run learns well above chance: a lighter network (A = 8, B = C = D = 2) on 1,000
    # images in batches of 32 left 1 iteration at 0.11-0.17, near the 0.1 of guessing. The 40x40 transfer test
    # uses the first transfer_images test digits. compare_schedule: the inverse-temperature schedule of
    # the comparison ("constant": every iteration at final_lambda, so that lambda does not depend on T). The
    # authors' schedule on the unnormalised cost (UNIT_STUDY_SCHEDULES) is compared in the small world (WORLD) and
    # in the paper-scale units, not on these digits: repeated here (2026-11-28/29, 5 seeds), its runs reached
    # 0.10-0.51 test accuracy and up to 2 of 9 runs of one execution ended at chance, while the 9 runs cost 20 s of
    # the chapter's time at 2 threads (29 s at 1 thread), which the 2-minute budget could not keep.
    # Viewpoint test: the main network and viewpoint_seeds CNNs of matched size (SmallConvNet), each
    # stopped at its first epoch (of at most viewpoint_epochs) whose validation accuracy reaches the EM
    # network's, tested on the first viewpoint_images test digits turned by each of viewpoint_angles.
    # viewpoint_mid: the angle at which the seeds' runs are compared (the middle of the turned ones, where
    # neither network is at its floor: at 60 degrees both score near chance at ci); viewpoint_margin: the
    # margin of practical equivalence of the EM network's accuracy lost there minus the CNN's, declared
    # before the chapter's re-executions over seeds 0-4 measured it (as turn_margin of the small world).
    # viewpoint_train_turn: the restricted range of the paper's protocol on digits: a second EM network and its
    # matched CNNs train on digits each turned by its own angle in [-viewpoint_train_turn, viewpoint_train_turn]
    # degrees (RandomTurn below, new angles every batch), a third of the range tested; the turned test
    # angles above it are the novel ones.
    ci=dict(dataset="embedded", A=16, B=4, C=4, D=4, iterations=3, train_subset=None, epochs=3, batch_size=32,
            lr=2e-3, lr_decay=None, margin=(0.2, 0.9), final_lambda=FINAL_LAMBDA, normalize=NORMALIZE,
            init_std=W_INIT_STD, compare_iterations=(1, 2, 3), compare_epochs=1, compare_subset=2000,
            compare_sizes=(16, 4, 4, 4), compare_batch_size=16, compare_seeds=3, compare_schedule="constant", cost_rounds=15, hist_images=16,
            affine_size=40, transfer_images=250,
            viewpoint_angles=(0, 20, 40, 60), viewpoint_images=500, viewpoint_seeds=3, viewpoint_epochs=10,
            viewpoint_lr=3e-3, viewpoint_mid=40, viewpoint_margin=0.05, viewpoint_train_turn=20,
            eval_batch=50, calibrate_images=256, **WORLD),
    # The paper's network (Sec. 5, Fig. 1): A = B = C = D = 32, K = 3, 3 routing iterations,
    # spread loss with the margin raised linearly from 0.2 to 0.9, Adam; on full MNIST here
    # (smallNORB when its files are present: capslib.data.smallnorb()). EM routing keeps every
    # vote of ConvCaps1 in memory (about 0.1 GB per 28x28 image and 0.25 GB per 40x40 image
    # without gradients, measured on CPU), so evaluation goes in batches of eval_batch images.
    # The iteration comparison trains the paper's network for compare_epochs epoch(s) per run
    # (3 iteration counts x compare_seeds seeds, under each of the two schedules). The EM network is slow:
    # capslib.tools.bench measured about 1,000 training images/s on one H100 (eager), so `full` trains 8 epochs
    # and compares iterations over 3 seeds x 1 epoch per schedule: about 25 minutes of training on one H100.
    # CAPSBOOK_PAPER_SCHEDULE=1 trains 50 epochs and compares over 5 seeds x 5 epochs (about 2 hours).
    full=dict(dataset="mnist", A=32, B=32, C=32, D=32, iterations=3, train_subset=None, epochs=8, batch_size=32,
              lr=3e-3, lr_decay=0.96, margin=(0.2, 0.9), final_lambda=FINAL_LAMBDA, normalize=NORMALIZE,
              init_std=W_INIT_STD, compare_iterations=(1, 2, 3), compare_epochs=1, compare_subset=None,
              compare_sizes=(32, 32, 32, 32), compare_batch_size=32, compare_seeds=3, compare_schedule="constant", cost_rounds=15, hist_images=64,
              affine_size=40, transfer_images=None,
              viewpoint_angles=(0, 20, 40, 60), viewpoint_images=None, viewpoint_seeds=3, viewpoint_epochs=10,
              viewpoint_lr=3e-3, viewpoint_mid=40, viewpoint_margin=0.05, viewpoint_train_turn=20,
              eval_batch=64, calibrate_images=64, **WORLD),
    paper=dict(epochs=50, compare_epochs=5, compare_seeds=5),
    # a smoke run of the paper's EM network on two CPU cores takes about 6 s a step of 32 images and 2 s to
    # score 32: fewer comparison runs, on fewer images, and smaller transfer and viewpoint test sets
    smoke=dict(compare_subset=64, compare_seeds=2, viewpoint_seeds=2, transfer_images=64, viewpoint_images=64),
)


# ============================================================================= the small world of the iteration study

def _rotations(th: torch.Tensor) -> torch.Tensor:
    """4x4 poses turning the plane by the angles ``th`` (radians), one per entry."""
    P = torch.eye(4).repeat(len(th), 1, 1)
    P[:, 0, 0], P[:, 0, 1], P[:, 1, 0], P[:, 1, 1] = th.cos(), -th.sin(), th.sin(), th.cos()
    return P


def _object_poses(n: int, g: torch.Generator, max_angle: float = _math.pi) -> torch.Tensor:
    """``n`` random 4x4 poses: an in-plane rotation by an angle uniform in [-max_angle, max_angle) and a translation
    N(0, 0.5^2)."""
    P = _rotations((torch.rand(n, generator=g) * 2 - 1) * max_angle)
    P[:, :2, 3] = 0.5 * torch.randn(n, 2, generator=g)
    return P


def part_transforms(classes: int, parts: int, seed: int = 1234) -> torch.Tensor:
    """The world's fixed part transforms ``P (parts, classes, 4, 4)``: part ``t`` of an object of class ``k`` sits at
    ``O P_tk^-1`` when the object sits at ``O``."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([_object_poses(classes, g) for _ in range(parts)])


def part_pose_world(n: int, transforms: torch.Tensor, outliers: float, noise: float, seed: int,
                    max_degrees: float = 180.0):
    """``n`` examples of the small world: part poses ``(n, parts, 4, 4)`` and classes ``(n,)``. Each part of an
    object of class ``k`` at pose ``O`` (turned by at most ``max_degrees`` either way) sits at ``O P_tk^-1`` plus
    N(0, noise^2) per entry; with probability ``outliers`` a part is replaced by a random pose (any angle, plus
    N(0, 0.3^2) per entry)."""
    if not 0 <= outliers < 1 or noise < 0:
        raise ValueError(f"outliers must lie in [0, 1) and noise be >= 0; got {outliers}, {noise}")
    if not 0 <= max_degrees <= 180:
        raise ValueError(f"max_degrees must lie in [0, 180]; got {max_degrees}")
    parts, classes = transforms.shape[:2]
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(classes, (n,), generator=g)
    O = _object_poses(n, g, _math.radians(max_degrees) if max_degrees < 180 else _math.pi)
    M = O[:, None] @ torch.linalg.inv(transforms)[:, y].transpose(0, 1)
    M = M + noise * torch.randn(M.shape, generator=g)
    clutter = torch.rand(n, parts, generator=g) < outliers
    random = _object_poses(n * parts, g).view(n, parts, 4, 4) + 0.3 * torch.randn(n, parts, 4, 4, generator=g)
    return torch.where(clutter[..., None, None], random, M), y


class PartWorldNet(torch.nn.Module):
    """The small world's network: one class-capsule layer (no coordinate addition) over the parts of an example,
    every part active. ``x (B, parts, 4, 4)`` -> :class:`capslib.em_layers.EMOutput`."""

    def __init__(self, layer: em_layers.ClassCaps):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> em_layers.EMOutput:
        B, parts = x.shape[:2]
        poses, act = self.layer(x.view(B, 1, 1, parts, 4, 4), x.new_ones(B, 1, 1, parts))
        return em_layers.EMOutput(act, poses)


def world_net(iterations: int, schedule: str, seed: int, cfg, train_set) -> PartWorldNet:
    """One class-capsule layer with ``iterations`` EM iterations under ``schedule`` (``"constant"``: the book's
    normalised cost at kappa_final = 1; ``"authors"``: the unnormalised cost at the authors' 0.01), trained on
    ``train_set = (x, y)`` of the small world by :func:`capslib.train.fit` with the spread loss (margin 0.2 -> 0.9)."""
    x_tr, y_tr = train_set
    lam, norm = (FINAL_LAMBDA, NORMALIZE) if schedule == "constant" else (em.AUTHORS_FINAL_LAMBDA, "none")
    torch.manual_seed(seed)
    net = PartWorldNet(em_layers.ClassCaps(x_tr.shape[1], cfg.world_classes, iterations=iterations,
                                           coordinate_addition=False, final_lambda=lam, normalize=norm,
                                           schedule=schedule, init_std=cfg.world_init_std))
    steps = cfg.world_epochs * _math.ceil(len(y_tr) / cfg.world_batch)
    train.fit(net, data.Split(x_tr, y_tr), em.SpreadLoss(steps), epochs=cfg.world_epochs, batch_size=cfg.world_batch,
              lr=cfg.world_lr, seed=seed, progress=False)
    return net


def world_run(iterations: int, schedule: str, seed: int, cfg, data_sets) -> dict:
    """One class-capsule layer with ``iterations`` EM iterations under ``schedule`` (``"constant"``: the book's
    normalised cost at kappa_final = 1; ``"authors"``: the unnormalised cost at the authors' 0.01), trained on the
    small world by :func:`capslib.train.fit` with the spread loss (margin 0.2 -> 0.9); its test accuracy, the
    mean activation of the true class and of the others on the test examples, and the network routed one iteration
    at a time on them (:func:`world_trace`, as ``"<key>, iteration <t>"``)."""
    (x_tr, y_tr), (x_te, y_te) = data_sets
    net = world_net(iterations, schedule, seed, cfg, (x_tr, y_tr))
    with torch.no_grad():
        act = net.eval()(x_te).activations
    true = torch.nn.functional.one_hot(y_te, cfg.world_classes).bool()
    trace = world_trace(net, x_te, y_te)
    return {"test accuracy": float((act.argmax(1) == y_te).float().mean()),
            "activation, true class": float(act[true].mean()), "activation, other classes": float(act[~true].mean()),
            **{f"{key}, iteration {t + 1}": v for key, values in trace.items() for t, v in enumerate(values)}}


@torch.no_grad()
def world_trace(net: PartWorldNet, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The trained layer's EM routing on ``x`` one iteration at a time (:func:`capslib.em.em_trace`): after each
    iteration, the mean activation of the true class and of the other classes, and the mean log variance (over the
    16 pose entries and the examples) of the true class's parent and of the others'. Lists, one entry an
    iteration."""
    layer = net.layer
    B, parts = x.shape[:2]
    votes_t, a_in = layer.votes(x.view(B, 1, 1, parts, 4, 4), x.new_ones(B, 1, 1, parts))
    states = em.em_trace(votes_t.flatten(3).transpose(1, 2), a_in, layer.beta_u, layer.beta_a,
                         iterations=layer.iterations, final_lambda=layer.final_lambda, normalize=layer.normalize,
                         schedule=layer.schedule)
    true = torch.nn.functional.one_hot(y, states[0].a.shape[1]).bool()
    logvar = [st.sigma2.log().mean(-1) for st in states]                       # (B, J) per iteration
    return {"a_true": [float(st.a[true].mean()) for st in states],
            "a_other": [float(st.a[~true].mean()) for st in states],
            "logvar_true": [float(v[true].mean()) for v in logvar],
            "logvar_other": [float(v[~true].mean()) for v in logvar]}


def turn_poses(x: torch.Tensor, degrees: float, seed: int) -> torch.Tensor:
    """Every example of ``x (n, parts, 4, 4)`` seen from a new viewpoint: all its part poses turned in the plane by
    ``degrees``, one way or the other at random (a sign per example, drawn from ``seed``)."""
    sign = torch.randint(2, (len(x),), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return _rotations(_math.radians(degrees) * sign.to(x.dtype))[:, None] @ x


class RandomTurn:
    """A training-time augmentation for :func:`capslib.train.fit`: every image of a batch turned about its centre
    by its own angle, drawn uniformly from ``[-max_degrees, max_degrees]`` (:func:`capslib.data.rotate`). Seeded;
    the angles are drawn on the CPU, so a run draws the same ones on any device. The restricted range of training
    turns of the chapter's viewpoint test on digits."""

    def __init__(self, max_degrees: float, seed: int = 0):
        if not (isinstance(max_degrees, (int, float)) and _math.isfinite(max_degrees) and 0 <= max_degrees <= 180):
            raise ValueError(f"max_degrees must be a number in [0, 180]; got {max_degrees!r}")
        self.max_degrees, self.seed = float(max_degrees), int(seed)
        self._gen = torch.Generator().manual_seed(self.seed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or not x.is_floating_point():
            raise ValueError(f"x must be a floating (B, C, H, W) tensor; got {x.dtype} of shape {tuple(x.shape)}")
        if self.max_degrees == 0:
            return x
        u = torch.rand(x.shape[0], generator=self._gen, dtype=torch.float64)
        return data.rotate(x, (2.0 * u - 1.0) * self.max_degrees, seed=None)

    def __repr__(self) -> str:
        return f"RandomTurn(max_degrees={self.max_degrees:g}, seed={self.seed})"


class PoseMLP(torch.nn.Module):
    """The small world's baseline: a perceptron with two hidden ReLU layers of ``width`` on the flattened part poses
    ``x (B, parts, 4, 4)`` -> class scores ``(B, classes)``."""

    def __init__(self, parts: int, classes: int, width: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16 * parts, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def cross_entropy_step(net, x, y):
    """The step of a plain classifier for :func:`capslib.train.fit`: cross-entropy of its scores, and the scores."""
    scores = net(x)
    return torch.nn.functional.cross_entropy(scores, y), scores.detach()


def train_to_match(net: torch.nn.Module, train_set: data.Split, loss_fn, target: float, *, val: data.Split,
                   epochs: int, batch_size: int, lr: float, seed: int, checkpoint=None,
                   augment=None) -> tuple[int, float]:
    """Train ``net`` by :func:`capslib.train.fit` until its validation accuracy reaches ``target`` (at most ``epochs``
    epochs) and leave it with the weights of the first epoch that reached it, or of its best epoch if none did (the
    matched-accuracy protocol of a viewpoint test's baseline). ``augment``: applied to every training batch
    (:func:`capslib.train.fit`). Returns (epochs trained to those weights, their validation accuracy)."""

    def keep_weights(epoch, model, history):
        # every epoch's weights travel in the history (and so in the checkpoint): a resumed run that trained further
        # (for a higher target) still has the weights of the first epoch that reaches this one
        history.setdefault("weights", []).append({k: v.detach().clone() for k, v in model.state_dict().items()})

    h = train.fit(net, train_set, loss_fn, epochs=epochs, batch_size=batch_size, lr=lr, val=val, seed=seed,
                  on_epoch_end=keep_weights, progress=False, stop_when=lambda hist: max(hist["val_acc"]) >= target,
                  checkpoint=checkpoint, augment=augment)
    reached = [e for e, acc in enumerate(h["val_acc"]) if acc >= target]
    epoch = reached[0] if reached else int(np.argmax(h["val_acc"]))
    net.load_state_dict(h["weights"][epoch])
    return epoch + 1, h["val_acc"][epoch]


def turn_sets(cfg, transforms: torch.Tensor):
    """The viewpoint test's data: training and validation objects turned by at most ``turn_familiar`` degrees, and
    ``{angle: Split}`` of the same test objects turned by each of ``turn_angles`` degrees."""
    kw = dict(outliers=cfg.world_outliers, noise=cfg.world_noise, max_degrees=cfg.turn_familiar)
    train_set = data.Split(*part_pose_world(cfg.world_train, transforms, seed=100, **kw))
    val = data.Split(*part_pose_world(cfg.turn_val, transforms, seed=555, **kw))
    x, y = part_pose_world(cfg.world_test, transforms, seed=999, **kw)
    return train_set, val, {a: data.Split(turn_poses(x, a, seed=a), y) for a in cfg.turn_angles}


def turn_run(seed: int, cfg, sets) -> dict:
    """One seed of the viewpoint test: the EM layer (``turn_iterations`` iterations, constant schedule) and the
    perceptron matched to its validation accuracy, trained on the familiar viewpoints; which test objects each
    gets right at every angle (``right[model][angle]``, bool, the same objects at every angle), and the
    perceptron's epochs and validation accuracy beside the EM layer's."""
    train_set, val, tests = sets
    em_net = world_net(cfg.turn_iterations, "constant", seed, cfg, (train_set.x, train_set.y))
    em_val = train.evaluate(em_net, val)
    torch.manual_seed(seed)
    mlp = PoseMLP(train_set.x.shape[1], cfg.world_classes, cfg.turn_mlp_width)
    epochs, mlp_val = train_to_match(mlp, train_set, cross_entropy_step, em_val, val=val, epochs=cfg.turn_mlp_epochs,
                                     batch_size=cfg.world_batch, lr=cfg.turn_mlp_lr, seed=seed)
    right = {name: {a: train.correct(net, s) for a, s in tests.items()} for name, net in (("em", em_net), ("mlp", mlp))}
    return {"right": right, "em_val": em_val, "mlp_val": mlp_val, "mlp_epochs": epochs,
            "params": {name: sum(p.numel() for p in net.parameters()) for name, net in (("em", em_net), ("mlp", mlp))}}


# ============================================================================= paper scale as experiment units
#
# Every training that chapter 5's paper-scale section rests on, as one unit per configuration and seed
# (see :mod:`capslib.book.units`). smallNORB, the paper's dataset, is not available offline here, so the
# units train on MNIST (55,000 training digits, 5,000 for validation, the 10,000 test digits):
#
# - ``05/main/s<k>``: the paper's network (A = B = C = D = 32, K = 3, 3 routing iterations, coordinate
#   addition), the book's inverse-temperature ramp and normalised cost, the spread loss with the margin
#   rising from 0.2 to 0.9 over the run. Measured: test accuracy; the same network on the test digits
#   centred on 40x40 canvases and affNIST-style distorted there (never trained on either); the test digits
#   turned by each of VIEWPOINT_ANGLES; and the paper's Fig. 2 on FIG2_IMAGES test digits: after each
#   routing iteration of the class layer, the assignment-weighted distances of the votes to their parents'
#   means (true class and the other nine), the assignment entropy and the weight on the true class; and the
#   test accuracy with the renormalisation pitfall of capslib.em switched on in every routed layer.
# - ``05/iterations/<schedule>/T<T>/s<k>``: the same network with T = 1, 2, 3 routing iterations in
#   every routed layer, under two inverse-temperature schedules that do not depend on T: "authors", the
#   schedule Hinton et al. gave (lambda_t = 0.01 (1 - 0.95^(t+1)), with the unnormalised cost it was given
#   for), and "constant" (lambda = 1 in every iteration with the book's normalised cost, the chapter's own
#   control). Measured: test accuracy and the class layer's assignment entropy after each iteration.
#
# Schedule: UNIT_SCHEDULE["epochs"] epochs, not the 50 of the book's paper schedule, so that each unit projects within 8
# minutes on one H100 at the step bench's rate for this network (``em32``, about 940 images/s); the
# evaluations after training (about 100,000 forward passes) take about a minute more.


UNIT_FAMILY = "em32"
# ``version`` counts changes to what the units' ``run`` or ``capslib.train.fit`` do that the probe cannot
# see (bump it with such a change: every chapter-5 result then reads stale).
UNIT_SCHEDULE = dict(version=2, dataset="mnist", split_seed=0, validation=5000, train_images=55_000, epochs=5,
                     paper_epochs=50, batch_size=32, lr=3e-3, lr_decay=0.96, margin=[0.2, 0.9], optimizer="Adam",
                     calibrate_images=64, eval_batch=64,
                     precision="float32 weights and activations, TF32 products and convolutions",
                     step="fit's fast path: whole batches only (the last partial batch of each epoch dropped), "
                          "fused Adam, the step captured in a CUDA graph where the capture works; the margin "
                          "advanced by a counter on the device")
UNIT_SIZES = dict(A=32, B=32, C=32, D=32)
UNIT_SEEDS = (0, 1, 2)
UNIT_ITERATIONS = (1, 2, 3)
# inverse-temperature schedules of the iteration study: (final lambda, cost normalisation)
UNIT_STUDY_SCHEDULES = {"authors": (em.AUTHORS_FINAL_LAMBDA, "none"), "constant": (FINAL_LAMBDA, NORMALIZE)}
VIEWPOINT_ANGLES = (0, 20, 40, 60)
AFFINE_SIZE = 40
FIG2_IMAGES = 64
FIG2_BINS = 40
# Smoke runs (CPU tests, rehearsals): the same code on the embedded digits, a tiny network, one epoch.
UNIT_SMOKE = dict(dataset="embedded", epochs=1, train=192, val=64, test=96, sizes=dict(A=4, B=2, C=2, D=2),
                  fig2_images=16, eval_batch=48)


class CountedSpreadLoss:
    """The spread loss with the margin of :func:`capslib.em.margin_at`, its step counted by a tensor on
    the device (advanced inside the step), so that a step captured in a CUDA graph and replayed still
    raises the margin: ``em.SpreadLoss`` counts in Python, which a replay would not advance."""

    def __init__(self, total_steps: int, start: float, end: float, device):
        self.total_steps, self.start, self.end = total_steps, float(start), float(end)
        self.step = torch.zeros((), dtype=torch.float64, device=device)

    def margin(self) -> torch.Tensor:
        if self.total_steps <= 1:
            return torch.full_like(self.step, self.end)
        frac = (self.step / (self.total_steps - 1)).clamp(0.0, 1.0)
        return self.start + (self.end - self.start) * frac

    def __call__(self, model, x, y):
        out = model(x)
        act = out.activations.float()
        loss = em.spread_loss(act, y, self.margin().to(act.dtype))
        self.step += 1
        return loss, out.activations


def unit_net(unit: Unit, smoke: bool = False) -> em_layers.EMCapsNet:
    cfg = unit.config
    sizes = UNIT_SMOKE["sizes"] if smoke else cfg["sizes"]
    return em_layers.EMCapsNet(**sizes, iterations=cfg["iterations"], final_lambda=cfg["final_lambda"],
                               normalize=cfg["normalize"], init_std=cfg["init_std"], schedule=cfg["schedule"])


def unit_probe(unit: Unit) -> dict:
    """One training step of the unit's network at full size in float64 on the CPU (weights drawn from
    seed 0, calibrated on two seeded random images, the spread loss at its first margin): the loss and
    the per-parameter gradient norms."""
    torch.manual_seed(0)
    net = built_in_float64(lambda: unit_net(unit))
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.tensor([3, 7])
    net.calibrate(x)
    loss, _ = CountedSpreadLoss(10, *unit.config["margin"], device="cpu")(net, x, y)
    loss.backward()
    return step_summary(loss, x, net)


@torch.no_grad()
def _sharpening(net: em_layers.EMCapsNet, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, dict]:
    """The paper's Fig. 2 on test digits ``x``: the class layer's EM routing one iteration at a time."""
    net.eval()
    pose, a_child = net.capsules(x)[-1]
    votes_t, a_in = net.class_caps.votes(pose, a_child)
    votes = votes_t.flatten(3).transpose(1, 2).float()                      # (N, I, J, 16)
    a_in = a_in.float()
    cc = net.class_caps
    states = em.em_trace(votes, a_in, cc.beta_u.float(), cc.beta_a.float(), iterations=cc.iterations,
                         final_lambda=cc.final_lambda, normalize=cc.normalize, schedule=cc.schedule)
    is_true = torch.nn.functional.one_hot(y, votes.shape[2]).bool()[:, None, :].expand(votes.shape[:3])
    dist = [(votes - st.mu[:, None]).norm(dim=-1) for st in states]
    weight = [st.R * a_in[:, :, None] for st in states]
    top = float(torch.quantile(dist[0].flatten().float().cpu(), 0.98)) or 1.0
    hist_true, hist_other, share, entropy = [], [], [], []
    for d, w, st in zip(dist, weight, states):
        for mask, n_caps, out in ((is_true, 1, hist_true), (~is_true, votes.shape[2] - 1, hist_other)):
            h = np.histogram(d[mask].cpu().numpy(), bins=FIG2_BINS, range=(0, top),
                             weights=w[mask].cpu().numpy() / (len(x) * n_caps))[0]
            out.append(h)
        share.append(float((w * is_true).sum() / w.sum()))
        entropy.append(float((-(st.R.clamp_min(1e-12).log() * st.R).sum(-1) * a_in).sum() / a_in.sum()))
    metrics = {"images": len(x), "weight_on_true_class": share, "assignment_entropy_nats": entropy,
               "uniform_entropy_nats": _math.log(votes.shape[2])}
    arrays = {"fig2_true": encode_array(np.stack(hist_true)), "fig2_other": encode_array(np.stack(hist_other)),
              "fig2_range": encode_array(np.array([0.0, top]))}
    return metrics, arrays


def unit_run(unit: Unit, device: torch.device, smoke: bool) -> dict:
    """Train the unit's network (see the notes above) and measure it."""
    cfg = unit.config
    cuda_speed_settings(device, benchmark=False)
    splits = data.load(UNIT_SMOKE["dataset"] if smoke else cfg["dataset"], device=device, seed=cfg["split_seed"])
    tr, val, test = splits["train"], splits["val"], splits["test"]
    if smoke:
        tr, val, test = tr.subset(UNIT_SMOKE["train"]), val.subset(UNIT_SMOKE["val"]), test.subset(UNIT_SMOKE["test"])
    elif (len(tr), len(val)) != (cfg["train_images"], cfg["validation"]):
        raise ValueError(f"{unit.key}: expected {cfg['train_images']:,} training and {cfg['validation']:,} validation "
                         f"digits; got {len(tr):,} and {len(val):,} (a smoke setting in the environment?)")
    epochs = UNIT_SMOKE["epochs"] if smoke else cfg["epochs"]
    eval_batch = UNIT_SMOKE["eval_batch"] if smoke else cfg["eval_batch"]
    torch.manual_seed(unit.seed)
    net = unit_net(unit, smoke).to(device)
    net.calibrate(tr.x[:cfg["calibrate_images"]])
    loss_fn = CountedSpreadLoss(epochs * (len(tr) // cfg["batch_size"]), *cfg["margin"], device=device)
    history = train.fit(net, tr, loss_fn, epochs=epochs, batch_size=cfg["batch_size"], lr=cfg["lr"],
                        lr_decay=cfg["lr_decay"], val=val, seed=unit.seed, amp=False, progress=True,
                        eval_batch_size=eval_batch, desc=unit.key,
                        fast="static" if os.environ.get("CAPSBOOK_NO_GRAPH", "").strip() not in ("", "0") else True)
    acc = train.evaluate(net, test, batch_size=eval_batch)
    nonfinite = int(history.get("nonfinite_steps", 0)) + int((~np.isfinite(history["loss"])).sum())
    metrics = {"test_accuracy": acc, "test_error": 1 - acc, "test_images": len(test), "epochs": epochs,
               "train_images": len(tr), "final_val_accuracy": history["val_acc"][-1], "nonfinite_losses": nonfinite,
               "final_margin": float(loss_fn.margin()), "params": sum(p.numel() for p in net.parameters()),
               "images_per_s_median": float(np.median(history["images_per_s"])),
               "seconds_per_epoch_median": train.seconds_per_epoch(history),
               "step_path": history.get("step_path"), "step_path_reason": history.get("step_path_reason")}
    n_fig2 = UNIT_SMOKE["fig2_images"] if smoke else FIG2_IMAGES
    fig2, arrays = _sharpening(net, test.x[:n_fig2], test.y[:n_fig2])
    metrics["sharpening"] = fig2
    if unit.name == "main":
        padded = data.Split(data.pad_to(test.x, AFFINE_SIZE), test.y)
        affine = data.Split(data.affine(test.x, size=AFFINE_SIZE), test.y)
        metrics["transfer"] = {"centred_40": train.evaluate(net, padded, batch_size=eval_batch),
                               "affine_40": train.evaluate(net, affine, batch_size=eval_batch)}
        metrics["viewpoint"] = {str(a): acc if a == 0 else
                                train.evaluate(net, data.Split(data.rotate(test.x, a, seed=a), test.y), batch_size=eval_batch)
                                for a in VIEWPOINT_ANGLES}
        net.renormalise_over_parents = True            # the pitfall of capslib.em, switched on the trained network
        try:
            metrics["pitfall"] = {"renormalised_test_accuracy": train.evaluate(net, test, batch_size=eval_batch)}
        finally:
            net.renormalise_over_parents = False
    else:
        arrays = {}    # the iteration study keeps the numbers of its sharpening, not the histograms
    hist = {k: v for k, v in history.items() if isinstance(v, list)}
    return {"metrics": metrics, "history": hist, "arrays": arrays}


def _unit_config(iterations: int, schedule: str, final_lambda: float, normalize: str) -> dict:
    return {**UNIT_SCHEDULE, "sizes": UNIT_SIZES, "iterations": iterations, "schedule": schedule,
            "final_lambda": final_lambda, "normalize": normalize, "init_std": W_INIT_STD}


def _register() -> None:
    images = UNIT_SCHEDULE["epochs"] * UNIT_SCHEDULE["train_images"]
    main = _unit_config(3, "ramp", FINAL_LAMBDA, NORMALIZE)
    for s in UNIT_SEEDS:
        register(Unit("05", "main", s, unit_run, main, unit_probe, UNIT_FAMILY, images, 10 + 20 * s,
                      "the paper's EM network on MNIST: test error, 40x40 transfer, rotated digits, Fig. 2, "
                      "the renormalisation pitfall switched on"))
    for k, (sched, (lam, norm)) in enumerate(UNIT_STUDY_SCHEDULES.items()):
        for T in UNIT_ITERATIONS:
            for s in UNIT_SEEDS:
                register(Unit("05", f"iterations/{sched}/T{T}", s, unit_run, _unit_config(T, sched, lam, norm),
                              unit_probe, UNIT_FAMILY, images, 11 + 20 * s + 3 * k + T,
                              f"iteration study: {T} routing iteration{'s' * (T > 1)}, inverse temperature "
                              f"'{sched}'"))


_register()


def _declare_paper_scale() -> None:
    """The rows of the chapter's comparison table these units measure (the paper reports none of them: its
    numbers are smallNORB's); the iteration rows as the `ci` comparison runs them, at a constant inverse
    temperature."""
    from .units import paper_scale

    paper_scale("MNIST test error, 3 iterations", "05/main", lambda m: m["test_error"], ".2%", row=True)
    paper_scale("affNIST-style test error, 3 iterations", "05/main", lambda m: 1 - m["transfer"]["affine_40"], ".1%",
                row=True)
    for T in UNIT_ITERATIONS:
        paper_scale(f"MNIST test error, iteration comparison, T = {T}", f"05/iterations/constant/T{T}",
                    lambda m: m["test_error"], ".2%", row=True)
    far = VIEWPOINT_ANGLES[-1]
    paper_scale(f"digits turned {far}° (never seen), error: EM / matched CNN", "05/main",
                lambda m: 1 - m["viewpoint"][str(far)], ".1%", row=True, what="EM")


_declare_paper_scale()


# ----------------------------------------------------------------------------- the chapter's paper-scale views

SCHEDULE_LABELS = {"authors": "authors' schedule, unnormalised cost", "constant": "constant, normalised cost"}


def main_groups(smoke: bool = False):
    from .units import group
    return [group("05/main", "the paper's network, 3 iterations", smoke)]


def iteration_groups(smoke: bool = False) -> dict:
    """``{(schedule, T): Group}`` of the iteration study."""
    from .units import group
    return {(sched, T): group(f"05/iterations/{sched}/T{T}", f"{T} iteration{'s' * (T > 1)}, {SCHEDULE_LABELS[sched]}",
                              smoke)
            for sched in UNIT_STUDY_SCHEDULES for T in UNIT_ITERATIONS}


def _mean_sd(values: list, scale: float = 100.0, digits: int = 2) -> str:
    v = [scale * x for x in values]
    if not v:
        return "not yet run"
    return f"{np.mean(v):.{digits}f}" if len(v) == 1 else f"{np.mean(v):.{digits}f} ± {np.std(v, ddof=1):.{digits}f} (SD)"


def main_frame(groups):
    """The main network over its seeds: test error in per cent on MNIST, on the test digits centred on
    40x40 canvases and distorted there, and turned by each angle (mean and SD over the seeds run)."""
    import pandas as pd

    res = groups[0].results
    err = lambda f: _mean_sd([1 - f(r["metrics"]) for r in res])   # noqa: E731
    rows = [("MNIST test digits, 28x28", err(lambda m: m["test_accuracy"])),
            ("centred on 40x40 (never trained on)", err(lambda m: m["transfer"]["centred_40"])),
            ("affNIST-style on 40x40 (never trained on)", err(lambda m: m["transfer"]["affine_40"]))]
    rows += [(f"turned by {a}° (never trained on)", err(lambda m, a=a: m["viewpoint"][str(a)]))
             for a in VIEWPOINT_ANGLES if a]
    rows.append(("MNIST test digits, the renormalisation pitfall switched on",
                 err(lambda m: m["pitfall"]["renormalised_test_accuracy"])))
    frame = pd.DataFrame(rows, columns=["test digits", "test error (%)"]).set_index("test digits")
    frame["seeds"] = len(res)
    return frame


def iterations_frame(groups: dict):
    """Test error (%) by number of routing iterations and schedule (mean ± SD over the seeds run), and
    each T's difference to T = 1 paired by seed (mean over the seeds both have)."""
    import pandas as pd

    rows = {}
    for (sched, T), g in groups.items():
        ref = {r["seed"]: r["metrics"]["test_error"] for r in groups[(sched, 1)].results}
        paired = [100 * (r["metrics"]["test_error"] - ref[r["seed"]]) for r in g.results if r["seed"] in ref]
        rows[(SCHEDULE_LABELS[sched], T)] = {
            "test error (%)": _mean_sd(g.values("test_error")),
            "minus T = 1, same seed (points)": "—" if T == 1 else (f"{np.mean(paired):+.2f}" if paired else "not yet run"),
            "seeds": len(g.results)}
    frame = pd.DataFrame.from_dict(rows, orient="index")
    frame.index = pd.MultiIndex.from_tuples(frame.index, names=["inverse temperature", "T"])
    return frame


def draw_iterations(groups: dict):
    """Test error against the number of routing iterations T, one panel per schedule: each seed a point,
    the mean a line."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN

    if not any(g.results for g in groups.values()):
        raise ValueError("draw_iterations needs at least one result of the iteration study")
    scheds = list(UNIT_STUDY_SCHEDULES)
    fig, axes = plt.subplots(1, len(scheds), figsize=(COLUMN_IN, 3.0), sharey=True, squeeze=False)
    for ax, sched in zip(axes[0], scheds):
        means = []
        for T in UNIT_ITERATIONS:
            e = [100 * v for v in groups[(sched, T)].values("test_error")]
            ax.plot([T] * len(e), e, "o", color="C0", alpha=0.6, ms=4)
            means.append(np.mean(e) if e else np.nan)
        ax.plot(UNIT_ITERATIONS, means, "-", color="C0", lw=1.5)
        ax.set_xticks(UNIT_ITERATIONS)
        ax.set_xlabel("routing iterations $T$", fontsize=11)
        ax.set_title(SCHEDULE_LABELS[sched], fontsize=10)
    axes[0, 0].set_ylabel("test error (%)", fontsize=11)
    fig.tight_layout()
    return fig


def draw_fig2(result: dict):
    """The paper's Fig. 2 from a ``05/main`` result: after each routing iteration of the class layer,
    the assignment-weighted distances $\\lVert V_{ij} - \\mu_j \\rVert$ of the votes to the class of the
    digit (left) and to the nine others (right), weight per image and per class capsule."""
    import matplotlib.pyplot as plt

    from .units import decode_array
    from .viz import COLUMN_IN

    a = result["arrays"]
    ht, ho, rng = decode_array(a["fig2_true"]), decode_array(a["fig2_other"]), decode_array(a["fig2_range"])
    T, bins = ht.shape
    edges = np.linspace(rng[0], rng[1], bins + 1)
    ymax = 1.05 * max(ht.max(), ho.max())
    fig, axes = plt.subplots(T, 2, figsize=(COLUMN_IN, 2.0 * T + 0.6), sharex=True, sharey=True, squeeze=False)
    for t in range(T):
        for c, (h, title) in enumerate(((ht[t], "class of the digit"), (ho[t], "the nine other classes"))):
            axes[t, c].stairs(h, edges, fill=True, color="C0")
            axes[t, c].set_title(f"{title}, iteration {t + 1}", fontsize=10)
            axes[t, c].set_ylim(0, ymax)
        axes[t, 0].set_ylabel("weight per image\nper class capsule", fontsize=9)
    for c in range(2):
        axes[-1, c].set_xlabel("$\\|V_{ij} - \\mu_j\\|$", fontsize=11)
    fig.tight_layout()
    return fig


def draw_curves(results: list):
    """Validation accuracy after each epoch, one line per seed of the main network."""
    import matplotlib.pyplot as plt

    from .viz import COLUMN_IN

    if not results:
        raise ValueError("draw_curves needs at least one result of the main unit")
    fig, ax = plt.subplots(figsize=(COLUMN_IN * 0.7, 2.8))
    for r in results:
        v = r["history"]["val_acc"]
        ax.plot(range(1, len(v) + 1), [100 * (1 - x) for x in v], "o-", ms=3, label=f"seed {r['seed']}")
    ax.set_xlabel("epoch", fontsize=11)
    ax.set_ylabel("validation error (%)", fontsize=11)
    ax.legend(fontsize=9, frameon=False)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- viewpoint baseline

class SmallConvNet(nn.Module):
    """The CNN baseline of chapter 5's viewpoint test, sized by one ``width``: Conv 5x5 stride 2
    (``width`` channels, ReLU) -> Conv 3x3 stride 2 (``2 width``, ReLU) -> one linear layer to the
    classes. With the EM network's own first layer and stride, its size is set by
    :func:`matched_width` to the EM network's parameter count (the paper compared capsules with a
    CNN baseline; here the two are matched in size so that capacity is not the difference).

    ``forward(x (B, C_in, H, W))`` -> class scores ``(B, classes)``; any side of at least 11 pixels works
    (global average pooling before the linear layer)."""

    def __init__(self, width: int, in_channels: int = 1, classes: int = 10):
        super().__init__()
        for name, v in [("width", width), ("in_channels", in_channels), ("classes", classes)]:
            check_positive_int(name, v)
        self.in_channels = in_channels
        self.features = nn.Sequential(nn.Conv2d(in_channels, width, 5, 2), nn.ReLU(),
                                      nn.Conv2d(width, 2 * width, 3, 2), nn.ReLU(),
                                      nn.Conv2d(2 * width, 4 * width, 3, 1), nn.ReLU())
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, dims=4, floating=True, shape_doc="(B, C, H, W)")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"x must be (B, {self.in_channels}, H, W); got {tuple(x.shape)}")
        return self.head(self.features(x).mean(dim=(2, 3)))


def matched_width(target_params: int, in_channels: int = 1, classes: int = 10) -> int:
    """The ``width`` of :class:`SmallConvNet` whose parameter count is nearest ``target_params``
    (counted on built networks; the count grows with the width, so the search stops past the target)."""
    check_positive_int("target_params", target_params)

    def count(w):
        return sum(p.numel() for p in SmallConvNet(w, in_channels, classes).parameters())

    w, below = 1, count(1)
    while below < target_params:
        above = count(w + 1)
        if above >= target_params:
            return w if target_params - below <= above - target_params else w + 1
        w, below = w + 1, above
    return w
