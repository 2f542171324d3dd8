"""Chapter 5 (EM routing): its sizes per profile (``capslib.book.profiles.settings("05_em_routing")``); the chapter's
mathematics lives in the library: EM routing and the spread loss in :mod:`capslib.em`, the matrix-capsule
layers and networks in :mod:`capslib.em_layers`."""
from __future__ import annotations

from ..em import FINAL_LAMBDA, NORMALIZE
from ..em_layers import W_INIT_STD
from . import profiles

profiles.register(
    "05_em_routing",
    # CPU, embedded MNIST (28x28): a tiny network (A = 16, B = C = D = 4) trained on all 4000
    # embedded images for 3 epochs. The 1/2/3-iteration comparison (time budget: its 9 trainings take
    # about 20 s on 2 cores) trains a lighter network (compare_sizes = A, B, C, D) for 1 epoch on
    # compare_subset images, once per seed sess.seed + k, k < compare_seeds. The 40x40 transfer test
    # uses the first transfer_images test digits. compare_schedule: the inverse-temperature schedule of
    # the comparison ("constant": every iteration at final_lambda, so that lambda does not depend on T).
    # Viewpoint test: the main network and viewpoint_seeds CNNs of matched size (SmallConvNet), each
    # stopped at its first epoch (of at most viewpoint_epochs) whose validation accuracy reaches the EM
    # network's, tested on the first viewpoint_images test digits turned by each of viewpoint_angles.
    ci=dict(dataset="embedded", A=16, B=4, C=4, D=4, iterations=3, train_subset=None, epochs=3, batch_size=32,
            lr=2e-3, lr_decay=None, margin=(0.2, 0.9), final_lambda=FINAL_LAMBDA, normalize=NORMALIZE,
            init_std=W_INIT_STD, compare_iterations=(1, 2, 3), compare_epochs=1, compare_subset=1000,
            compare_sizes=(8, 2, 2, 2), compare_seeds=3, compare_schedule="constant", cost_rounds=15, hist_images=16,
            affine_size=40, transfer_images=250,
            viewpoint_angles=(0, 20, 40, 60), viewpoint_images=500, viewpoint_seeds=3, viewpoint_epochs=10,
            viewpoint_lr=3e-3,
            eval_batch=500, calibrate_images=256),
    # The paper's network (Sec. 5, Fig. 1): A = B = C = D = 32, K = 3, 3 routing iterations,
    # spread loss with the margin raised linearly from 0.2 to 0.9, Adam; on full MNIST here
    # (smallNORB when its files are present: capslib.data.smallnorb()). EM routing keeps every
    # vote of ConvCaps1 in memory (about 0.1 GB per 28x28 image and 0.25 GB per 40x40 image
    # without gradients, measured on CPU), so evaluation goes in batches of eval_batch images.
    # The iteration comparison trains the paper's network for compare_epochs epoch(s) per run
    # (3 iteration counts x compare_seeds seeds). The EM network is slow: capslib.tools.bench measured
    # about 1,000 training images/s on one H100 (eager), so `full` trains 8 epochs and compares
    # iterations over 3 seeds x 1 epoch: about 15 minutes of training on one H100.
    # CAPSBOOK_PAPER_SCHEDULE=1 trains 50 epochs and compares over 5 seeds x 5 epochs (about 2 hours).
    full=dict(dataset="mnist", A=32, B=32, C=32, D=32, iterations=3, train_subset=None, epochs=8, batch_size=32,
              lr=3e-3, lr_decay=0.96, margin=(0.2, 0.9), final_lambda=FINAL_LAMBDA, normalize=NORMALIZE,
              init_std=W_INIT_STD, compare_iterations=(1, 2, 3), compare_epochs=1, compare_subset=None,
              compare_sizes=(32, 32, 32, 32), compare_seeds=3, compare_schedule="constant", cost_rounds=15, hist_images=64,
              affine_size=40, transfer_images=None,
              viewpoint_angles=(0, 20, 40, 60), viewpoint_images=None, viewpoint_seeds=3, viewpoint_epochs=10,
              viewpoint_lr=3e-3,
              eval_batch=64, calibrate_images=64),
    paper=dict(epochs=50, compare_epochs=5, compare_seeds=5),
)
