"""``python -m capslib.tools.bench [--quick] [--compile] [--json PATH]``: training speed of each chapter's model.

For each chapter's ``full`` network (its sizes from :mod:`capslib.book.profiles`) one training step
(forward, backward, Adam) is timed on random images of the chapter's batch size, in float32 and
in bf16 autocast (CUDA only), eager and, with ``--compile``, through ``torch.compile``. Reported
per model and mode: images/s, the analytic FLOPs per image of forward + backward (counted by
``torch.utils.flop_counter``), the achieved TFLOP/s, the memory peak (CUDA) and, from the best
mode, the projected minutes of the chapter's ``full`` training schedule (:func:`schedule`).

``--quick`` shrinks every network and batch so that the whole run takes seconds on a CPU
(``make test`` runs it); its images/s say nothing about a GPU.

``python -m capslib.tools.bench fast-check [--json PATH]`` checks and times the fast training step
(:mod:`capslib.engine.steps`, ``capslib.train.fit(..., fast=True)``) on chapter 2's paper-size CapsNet: the
per-step losses of the first steps through the CUDA graph against the same steps run eagerly (same
batches and weights), then images/s of ``fit`` with ``fast`` off and on from the same seed. It exits
non-zero when the graph was not used or disagrees. Without a GPU it runs tiny sizes with a stand-in
for the graph calls (:class:`capslib.engine.steps.EagerGraphs`) and says so: a rehearsal of the code path.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..book import profiles
from ..book.timing import interleaved_seconds

FULL_TRAIN = 55_000   # full MNIST training images (5,000 of the 60k are held out for validation)


@dataclass
class Case:
    """One model to time: ``build()`` -> model, ``step(model, x, y)`` -> loss; input side; batch size."""
    name: str
    chapter: str
    build: Callable[[], torch.nn.Module]
    loss: Callable
    image_size: int
    batch_size: int


def _capsnet_loss(recon_weight: float):
    from ..models import capsnet_loss

    def loss(model, x, y):
        return capsnet_loss(model(x, y), x, y, recon_weight=recon_weight)
    return loss


def _margin_only(model, x, y):
    from ..ops import margin_loss
    v, _ = model.encode(x)  # chapter 6's network has no decoder: the decoder here is never run
    return margin_loss(v.float().norm(dim=-1), y)


def _spread(model, x, y):
    from ..em import spread_loss
    return spread_loss(model(x).activations.float(), y, 0.5)


def _reconstruction(model, x, y):
    return F.mse_loss(model(x).float(), x.float())


def cases(quick: bool = False) -> list[Case]:
    """The timed models: each chapter's ``full`` network (``quick``: tiny stand-ins of the same code)."""
    from ..em_layers import EMCapsNet
    from ..models import CapsNet
    from ..poe_models import ConvAutoencoder

    s2 = profiles.settings("02_dynamic_routing", "full")
    s5 = profiles.settings("05_em_routing", "full")
    s6 = profiles.settings("06_rem", "full")
    s7 = profiles.settings("07_products_of_expert_capsules", "full")
    if quick:
        caps = dict(conv_channels=8, primary_types=2, primary_dim=4, digit_dim=4, decoder=(16, 32))
        return [
            Case("CapsNet 28x28 (quick)", "02", lambda: CapsNet(**caps), _capsnet_loss(5e-4), 28, 8),
            Case("EM capsules (quick)", "05", lambda: EMCapsNet(A=4, B=2, C=2, D=2), _spread, 28, 4),
            Case("PoE autoencoder (quick)", "07", lambda: ConvAutoencoder(channels=4), _reconstruction, 28, 8),
        ]
    caps = dict(conv_channels=s2.conv_channels, primary_types=s2.primary_types, primary_dim=s2.primary_dim,
                digit_dim=s2.digit_dim, iterations=s2.iterations)
    return [
        Case("CapsNet 28x28 (ch. 2, 4)", "02", lambda: CapsNet(decoder=s2.decoder, **caps), _capsnet_loss(5e-4),
             28, s2.batch_size),
        Case("CapsNet 40x40, expanded (ch. 2, 4)", "02x",
             lambda: CapsNet(image_size=40, primary_stride=s2.expanded_primary_stride, decoder=s2.decoder, **caps),
             _capsnet_loss(5e-4), 40, s2.expanded_batch_size),
        Case("CapsNet without decoder (ch. 6)", "06",
             lambda: CapsNet(**{**caps, "conv_channels": s6.conv_channels}), _margin_only,
             28, s6.batch_size),
        Case("EM capsules A=B=C=D=32 (ch. 5)", "05",
             lambda: EMCapsNet(A=s5.A, B=s5.B, C=s5.C, D=s5.D, iterations=s5.iterations), _spread, 28, s5.batch_size),
        Case("PoE autoencoder (ch. 7)", "07", lambda: ConvAutoencoder(channels=s7.channels, kernel=s7.kernel),
             _reconstruction, 28, s7.ae_batch),
    ]


def flops_per_image(case: Case, device) -> float:
    """Forward + backward FLOPs of one training step, per image (``torch.utils.flop_counter``)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = case.build().to(device)
    x = torch.rand(case.batch_size, 1, case.image_size, case.image_size, device=device)
    y = torch.randint(0, 10, (case.batch_size,), device=device)
    with FlopCounterMode(display=False) as counter:
        case.loss(model, x, y).backward()
    return counter.get_total_flops() / case.batch_size


def time_steps(case: Case, device, amp: bool, compiled: bool, steps: int, warmup: int) -> dict:
    """Images/s of ``steps`` training steps after ``warmup`` (compilation included in warm-up)."""
    torch.manual_seed(0)
    model = case.build().to(device)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.rand(case.batch_size, 1, case.image_size, case.image_size, device=device)
    y = torch.randint(0, 10, (case.batch_size,), device=device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp and cuda):
            loss = case.loss(run, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def seconds(n: int) -> float:  # n steps, timed to the device's completion
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    warm_s = seconds(warmup)
    secs = seconds(steps)
    return {"images_per_s": steps * case.batch_size / secs, "warmup_s": warm_s,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None}


def schedule(chapter: str) -> dict:
    """The ``full`` profile's training work of a chapter, in image-epochs per timed model."""
    if chapter == "02":
        s = profiles.settings("02_dynamic_routing", "full")
        ablation = 4 * s.ablation_seeds * s.ablation_epochs * (s.ablation_train or FULL_TRAIN)  # Table 1's 4 cells
        multi = s.multimnist_epochs * s.multimnist_train          # 36x36 pairs, counted at the 28x28 rate
        return {"02": s.epochs * FULL_TRAIN + ablation + multi, "02x": s.compare_seeds * s.expanded_epochs * FULL_TRAIN}
    if chapter == "04":
        s = profiles.settings("04_coupling_gradient_proof", "full")
        n = s.train_subset or FULL_TRAIN
        return {"02": 2 * s.seeds * s.epochs * n, "02x": 2 * s.expanded_epochs * (s.expanded_subset or FULL_TRAIN)}
    if chapter == "05":
        s = profiles.settings("05_em_routing", "full")
        n = s.train_subset or FULL_TRAIN
        return {"05": s.epochs * n + len(s.compare_iterations) * s.compare_seeds * s.compare_epochs
                * (s.compare_subset or FULL_TRAIN)}
    if chapter == "06":
        s = profiles.settings("06_rem", "full")
        return {"06": 4 * getattr(s, "seeds", 1) * s.epochs * (s.train_subset or FULL_TRAIN)}
    if chapter == "07":
        s = profiles.settings("07_products_of_expert_capsules", "full")
        return {"07": s.ae_epochs * (s.unsupervised_subset or FULL_TRAIN)}
    raise KeyError(f"no schedule for chapter {chapter!r}")


def run(quick: bool = False, compile: bool = False, steps: int | None = None, device=None) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    steps = steps or (2 if quick else 20)
    warmup = 1 if quick else 3
    modes = [("fp32", False)] + ([("bf16", True)] if device.type == "cuda" else [])
    rows, best = [], {}
    for case in cases(quick):
        flops = flops_per_image(case, device)
        for label, amp in modes:
            # torch.compile is timed for the last mode only (bf16 on CUDA): its warm-up costs minutes
            for compiled in ([False, True] if compile and label == modes[-1][0] else [False]):
                r = time_steps(case, device, amp, compiled, steps, warmup + (2 if compiled else 0))
                r.update(model=case.name, key=case.chapter, mode=label + (" compile" if compiled else " eager"),
                         flops_per_image=flops, tflops=flops * r["images_per_s"] / 1e12)
                rows.append(r)
                best[case.chapter] = max(best.get(case.chapter, 0.0), r["images_per_s"])
                print(f"{case.name:38s} {r['mode']:13s} {r['images_per_s']:9.0f} img/s  "
                      f"{flops / 1e9:7.2f} GFLOP/img  {r['tflops']:6.1f} TFLOP/s"
                      + (f"  peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""), flush=True)
    projected = {}
    if not quick:
        for chapter in ("02", "04", "05", "06", "07"):
            work = schedule(chapter)
            if all(k in best for k in work):
                projected[chapter] = sum(n / best[k] for k, n in work.items()) / 60
                print(f"chapter {chapter}: full schedule's training ≈ {projected[chapter]:.1f} min at the best mode")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return {"device": name, "torch": torch.__version__, "quick": quick, "steps": steps, "rows": rows,
            "projected_minutes": projected}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m capslib.tools.bench", description=__doc__.splitlines()[0])
    p.add_argument("command", nargs="?", default="models", choices=["models", "fast-check"],
                   help="models: the step table (default); fast-check: the fast training step, checked and timed")
    p.add_argument("--quick", action="store_true", help="tiny networks, seconds on a CPU")
    p.add_argument("--compile", action="store_true", help="also time torch.compile")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--json", default=None, help="write the table here")
    a = p.parse_args(argv)
    if a.command == "fast-check":
        from .fast_check import fast_check
        out = fast_check(steps=a.steps)
        ok = out["ok"]
    else:
        out = run(quick=a.quick, compile=a.compile, steps=a.steps)
        ok = all(math.isfinite(r["images_per_s"]) for r in out["rows"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
