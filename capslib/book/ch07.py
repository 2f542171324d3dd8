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
# seeds and training capsules they use, and the sparsity term's weight and target firing probability.
profiles.register(
    CHAPTER,
    ci=dict(dataset="embedded", channels=32, kernel=9, capsule_dim=8, out_caps=20, out_dim=16,
            iterations=3, dropout=0.1, ae_epochs=1, ae_lr=3e-3, ae_batch=50, unsupervised_subset=2000,
            cd_epochs=3, cd_lr=0.05, cd_momentum=0.9, cd_decay=0.9, cd_l2=1e-4, cd_batch=50,
            dec_epochs=2, dec_lr=0.05, init_std=0.01, samples=4, purity_samples=20,
            classifier_epochs=1, classifier_subset=2000, seeds=3,
            control_subset=1000, control_seeds=1, sparsity_strength=100.0, sparsity_target=0.1),
    full=dict(dataset="mnist", channels=128, kernel=9, capsule_dim=8, out_caps=20, out_dim=16,
              iterations=3, dropout=0.1, ae_epochs=20, ae_lr=1e-3, ae_batch=128, unsupervised_subset=None,
              cd_epochs=30, cd_lr=0.05, cd_momentum=0.9, cd_decay=0.95, cd_l2=1e-4, cd_batch=128,
              dec_epochs=30, dec_lr=0.05, init_std=0.01, samples=4, purity_samples=500,
              classifier_epochs=10, classifier_subset=None, seeds=5,
              control_subset=None, control_seeds=5, sparsity_strength=100.0, sparsity_target=0.1),
)
