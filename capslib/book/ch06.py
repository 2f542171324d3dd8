"""Chapter 6 (REM): its sizes per profile (``capslib.book.profiles.settings("06_rem")``); the chapter's
mathematics and trainings live in the library, :mod:`capslib.rem`."""
from __future__ import annotations

from . import profiles

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
