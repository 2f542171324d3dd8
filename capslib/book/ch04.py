"""Chapter 4 (the coupling-gradient proof): its sizes per profile (``capslib.book.profiles.settings("04_coupling_gradient_proof")``); the chapter's
mathematics and trainings live in the library, :mod:`capslib.coupling_gradient`."""
from __future__ import annotations

from . import profiles
from ..coupling_gradient import CHAPTER

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
