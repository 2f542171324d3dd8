"""One switch for scale: ``CAPSBOOK_PROFILE=ci|full``.

``ci`` runs on two CPU cores with the embedded 5,000 MNIST digits, each chapter
in about two minutes or less on the processors measured (README: measured run times); ``full`` is the paper's architecture and schedule on
the full dataset, on a GPU. The default is ``full`` when CUDA is available and
``ci`` otherwise. Every experiment reads its sizes from :func:`settings`.

``CAPSBOOK_SMOKE=1`` shrinks any profile to a smoke test: the same networks, at most
``SMOKE_EPOCHS`` epochs per training and at most ``SMOKE_SPLITS`` images per split, with
checkpoints and results kept apart (``<profile>-smoke``). It checks that a profile runs
end to end (``make smoke``) before hours are spent on it; its numbers mean nothing.
"""
from __future__ import annotations

from types import SimpleNamespace

from ..engine.switches import (PROFILES, SMOKE_EPOCHS, SMOKE_SPLITS, compile_requested, current,  # noqa: F401
                        paper_schedule, progress_bars, smoke, storage_name)

# Per-chapter sizes. Each chapter owns its block; keys are the experiment's knobs.
SIZES: dict[str, dict[str, dict]] = {
    # Chapter 2: CapsNet of Sabour et al. (Sec. 4). `full` is the paper's network.
    "02_dynamic_routing": {
        # expanded_*: the 40x40 CapsNet of the affine comparison (expanded_train: training digits per
        # seed, None = all); cnn_width: its CNN baseline's width; cnn_match_params: the notebook sizes the
        # CNN's hidden layer so that its parameter count is nearest the 40x40 CapsNet's (the paper matched them);
        # compare_margin / pitfall_margin: the margins of practical equivalence of that comparison's and of the
        # pitfall study's paired accuracy differences (the chapter's other studies declare theirs below);
        # compare_seeds: seeds of that comparison (sess.seed + k); affine_* / expand_shift: the
        # affNIST-style test set and the expanded training set (capslib.data.affine / expand);
        # pitfall_*: the pitfall study (capslib.pitfalls): training digits per seed, epochs, seeds and
        # the network's widths (each variant trains this network on the same digits and seeds).
        # ablation_*: Sabour's Table 1 as an ablation (routing iterations {1, 3} x reconstruction
        # {off, on}): training digits per seed (None = all), epochs, batch, seeds, the network's widths, and the
        # margin of practical equivalence of two cells' test accuracies, declared before the runs (the baseline
        # CNN trains beside the cells, its convolutions scaled like the network's).
        # shift_*: the paper's training augmentation (every digit moved by up to shift_max px each way) as a
        # study on the ablation's network: training digits per seed (None = all), epochs, seeds, the largest
        # shift, and the margin of practical equivalence of two test accuracies, declared before the runs.
        # multimnist_*: generated MultiMNIST pairs (capslib.multimnist) at a scale: digits averaged down by
        # multimnist_downsample (2 at ci: 14-px digits; 1 at full: the paper's 28 px) on a multimnist_canvas
        # canvas, shifted by up to multimnist_shift px (the paper's 36 and 4, halved at ci); the CapsNet's
        # kernels (multimnist_kernel), widths and decoder scaled with it; training pairs per seed, epochs,
        # batch, learning rate, seeds (sess.seed + k) and test pairs (the same for every seed). The paper
        # trained on 60M pairs; the experiment units (capslib.book.ch02) move each pair's digits anew every epoch.
        "ci": dict(dataset="embedded", conv_channels=32, primary_types=8, primary_dim=8, digit_dim=16,
                   decoder=(256, 512), iterations=3, epochs=4, batch_size=64, lr=2e-3, lr_decay=0.9,
                   expanded_epochs=2, expanded_batch_size=32, expanded_primary_stride=4, expanded_train=3000,
                   cnn_width=16, cnn_match_params=True, compare_margin=0.02, pitfall_margin=0.02,
                   compare_seeds=3, expand_shift=6, affine_rotation=20.0, affine_shear=(0.1, 0.2),
                   affine_scale=(0.8, 1.2), affine_shift=4.0, affnist_limit=10000,
                   pitfall_train=600, pitfall_epochs=1, pitfall_batch_size=32, pitfall_seeds=3,
                   pitfall_conv_channels=16, pitfall_primary_types=4, pitfall_decoder=(64,),
                   ablation_train=800, ablation_epochs=2, ablation_batch_size=32, ablation_seeds=3,
                   ablation_conv_channels=16, ablation_primary_types=4, ablation_decoder=(128, 256),
                   ablation_margin=0.02,
                   multimnist_downsample=2, multimnist_canvas=18, multimnist_shift=2, multimnist_kernel=5,
                   multimnist_conv_channels=32, multimnist_primary_types=4, multimnist_decoder=(128, 256),
                   multimnist_train=8000, multimnist_test=500, multimnist_epochs=3, multimnist_batch_size=64,
                   multimnist_lr=4e-3, multimnist_seeds=3,
                   shift_train=800, shift_epochs=4, shift_seeds=3, shift_max=2, shift_margin=0.02),
        "full": dict(dataset="mnist", conv_channels=256, primary_types=32, primary_dim=8, digit_dim=16,
                     decoder=(512, 1024), iterations=3, epochs=50, batch_size=128, lr=1e-3, lr_decay=0.96,
                     expanded_epochs=10, expanded_batch_size=128, expanded_primary_stride=2, expanded_train=None,
                     cnn_width=64, cnn_match_params=True, compare_margin=0.005, pitfall_margin=0.002,
                     compare_seeds=3, expand_shift=6, affine_rotation=20.0, affine_shear=(0.1, 0.2),
                     affine_scale=(0.8, 1.2), affine_shift=4.0, affnist_limit=None,
                     pitfall_train=10000, pitfall_epochs=3, pitfall_batch_size=128, pitfall_seeds=3,
                     pitfall_conv_channels=256, pitfall_primary_types=32, pitfall_decoder=(512, 1024),
                     ablation_train=None, ablation_epochs=8, ablation_batch_size=128, ablation_seeds=3,
                     ablation_conv_channels=256, ablation_primary_types=32, ablation_decoder=(512, 1024),
                     ablation_margin=0.002,
                     multimnist_downsample=1, multimnist_canvas=36, multimnist_shift=4, multimnist_kernel=9,
                     multimnist_conv_channels=256, multimnist_primary_types=32, multimnist_decoder=(512, 1024),
                     multimnist_train=200_000, multimnist_test=10_000, multimnist_epochs=10,
                     multimnist_batch_size=128, multimnist_lr=1e-3, multimnist_seeds=3,
                     shift_train=None, shift_epochs=8, shift_seeds=3, shift_max=2, shift_margin=0.002),
        # `full` fits one H100 in about 10 minutes, the shift study's 6 trainings about 3 of them
        # (capslib.tools.bench: 17k images/s for the 28x28 CapsNet, 9.5k for the 40x40 one, bf16 eager);
        # CAPSBOOK_PAPER_SCHEDULE=1 restores the longer schedule.
        "paper": dict(expanded_epochs=30, compare_seeds=5, ablation_epochs=50),
    },
}


# Chapters whose sizes live beside their code (registered when the module is imported).
CHAPTER_MODULES = {
    "03_soft_routing_gradients": "book.ch03",
    "04_coupling_gradient_proof": "book.ch04",
    "05_em_routing": "book.ch05",
    "06_rem": "book.ch06",
    "07_products_of_expert_capsules": "book.ch07",
}


def settings(chapter: str, profile: str | None = None) -> SimpleNamespace:
    """Sizes of ``chapter``'s experiments at ``profile`` (default: :func:`current`); in a smoke
    run the sizes are cut (:func:`_smoke_size`)."""
    profile = profile or current()
    if chapter not in SIZES and chapter in CHAPTER_MODULES:
        import importlib
        importlib.import_module(f"capslib.{CHAPTER_MODULES[chapter]}")
    if chapter not in SIZES:
        raise KeyError(f"no sizes for chapter {chapter!r}; known: {sorted(SIZES)}")
    sizes = dict(SIZES[chapter][profile])
    if profile == "full" and paper_schedule():
        sizes.update(_paper_sizes(chapter, SIZES[chapter]))
    if smoke():
        sizes = {k: _smoke_size(k, v) for k, v in sizes.items()}
        for k, cut in SIZES[chapter].get("smoke", {}).items():   # the chapter's own further cuts
            sizes[k] = cut if sizes[k] is None else min(sizes[k], cut)
    return SimpleNamespace(profile=profile, **sizes)


def _smoke_size(key: str, value):
    """A setting in a smoke run: every positive ``*epochs`` cut to ``SMOKE_EPOCHS``, and every count of
    examples a chapter makes itself (``*_train``, ``*_test``: MultiMNIST pairs, a small world's objects) to
    at most ``SMOKE_SPLITS``' train and test sizes, as the loaded splits are."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return value
    if key.endswith("epochs"):
        return min(value, SMOKE_EPOCHS)
    for suffix, split in (("_train", "train"), ("_test", "test")):
        if key.endswith(suffix):
            return min(value, SMOKE_SPLITS[split])
    return value


def register(chapter: str, ci: dict, full: dict, paper: dict | None = None, smoke: dict | None = None) -> None:
    """Add a chapter's sizes (used by chapter modules that keep their sizes beside their code);
    ``paper``: the keys of ``full`` that ``$CAPSBOOK_PAPER_SCHEDULE`` changes; ``smoke``: counts (of runs,
    of images) that a smoke run cuts further than :func:`_smoke_size` does, where the chapter's networks are
    slow even on a few hundred images (each applies as ``min(value, cut)``, ``None`` counting as all)."""
    entry = {"ci": dict(ci), "full": dict(full), "paper": dict(paper or {}), "smoke": dict(smoke or {})}
    _paper_sizes(chapter, entry)
    unknown = sorted(set(entry["smoke"]) - (set(entry["full"]) & set(entry["ci"])))
    if unknown:
        raise KeyError(f"{chapter}: smoke keys {unknown} are not keys of both profiles")
    bad = sorted(k for k, v in entry["smoke"].items() if not (isinstance(v, int) and not isinstance(v, bool) and v > 0))
    if bad:
        raise ValueError(f"{chapter}: smoke cuts must be positive ints; {bad} are not")
    SIZES[chapter] = entry


def _paper_sizes(chapter: str, entry: dict) -> dict:
    """A chapter's ``paper`` sizes, checked to name only keys of its ``full`` profile."""
    paper = entry.get("paper", {})
    unknown = sorted(set(paper) - set(entry["full"]))
    if unknown:
        raise KeyError(f"{chapter}: paper-schedule keys {unknown} are not keys of the full profile")
    return paper
