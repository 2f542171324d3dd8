"""``python -m capslib.tools.bench fast-check``: is the fast training step right, and how fast is it?

On CUDA, with chapter 2's paper-size CapsNet (its ``full`` sizes, batch 128, margin plus reconstruction
loss, random images; the content of the images does not change the time of a step):

1. **Agreement.** The first ``COMPARE`` steps on the same batches from the same weights, three ways:
   through the CUDA graph (:class:`capslib.engine.steps.GraphedSteps`: warm-up steps, capture, replays), run
   eagerly with the same optimizer (fused, capturable Adam; the graph's only difference), and eagerly
   with the plain Adam that ``fit`` makes when ``fast`` is off. TF32 off and cuDNN deterministic, so
   that the graph's numbers can be compared sharply. Reported: the largest relative difference of the
   per-step losses; the check fails above :data:`GRAPH_RTOL` (graph vs the same eager steps) or
   :data:`FUSED_RTOL` (vs the plain Adam, whose rounding differs in every update).
2. **Raw steps**, as ``../shared/bench/side_by_side.py`` times them (batch 100, one fixed batch, plain
   Adam, torch's default TF32 settings): images/s of the eager step and of the graphed step, the
   numbers to set beside that table's "capslib fp32" (13,475 images/s on an H200).
3. **Speed.** ``capslib.train.fit`` for two epochs of ``steps`` batches (plus a partial batch, which
   the fast path drops) with ``fast`` off and on, float32 with TF32 (as chapter 2's units train) and
   bf16 autocast; the second epoch's images/s (the first pays warm-up and capture), the step path
   used and the projected seconds of a 55,000-image epoch with a 5,000-image validation.

The check fails (exit 1) when the graph was not used (the reason is printed), when the graph's losses
disagree, or when a loss is not finite. Without CUDA it runs tiny sizes with
:class:`capslib.engine.steps.EagerGraphs` standing in for the graph calls: a rehearsal of the code path whose
numbers say nothing about a GPU.
"""
from __future__ import annotations

import math
import time

import torch

from .. import train
from ..engine import steps
from ..data import Split
from ..book.ch02 import capsnet_step
from ..models import CapsNet

COMPARE = 20          # steps compared between the graph and the eager step
GRAPH_RTOL = 1e-4     # graph vs the same optimizer run eagerly: the same kernels, so only rounding noise
FUSED_RTOL = 1e-3     # vs fit's plain Adam: fused rounding differs per update and compounds over the steps
FULL_EPOCH, FULL_VAL = 55_000, 5_000


capsnet_step_loss = capsnet_step(5e-4)    # margin loss plus the paper's reconstruction weight; returns (loss, lengths)


def capsnet_sizes(cuda: bool) -> dict:
    """Chapter 2's paper-size CapsNet (its ``full`` sizes) on CUDA; tiny stand-in sizes without it."""
    if not cuda:
        return dict(conv_channels=8, primary_types=2, primary_dim=4, digit_dim=4, decoder=(16, 32), iterations=3)
    from ..book import profiles
    s = profiles.settings("02_dynamic_routing", "full")
    return dict(conv_channels=s.conv_channels, primary_types=s.primary_types, primary_dim=s.primary_dim,
                digit_dim=s.digit_dim, decoder=s.decoder, iterations=s.iterations)


def _model(sizes: dict, device) -> CapsNet:
    torch.manual_seed(0)
    return CapsNet(**sizes).to(device)


def _batches(n: int, batch: int, device, seed: int = 7):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.rand(n, batch, 1, 28, 28, device=device, generator=g)
    y = torch.randint(0, 10, (n, batch), device=device, generator=g)
    return list(zip(x, y))


def _losses(model, optimizer, batches, runner_kind: str, backend=None) -> tuple[list[float], str, str | None]:
    """Per-step losses of ``batches`` through one runner of :mod:`capslib.engine.steps` (one host read at the end)."""
    sums = steps.StepSums(batches[0][0].device)

    def step(x, y):
        return steps.train_step(model, capsnet_step_loss, optimizer, x, y, sums)
    runner = steps.GraphedSteps(step, backend, optimizer) if runner_kind == "graphed" else steps.EagerSteps(step)
    out = []
    for x, y in batches:
        runner(x, y)
        out.append(runner.last_loss.detach().clone())
    return torch.stack(out).double().cpu().tolist(), runner.path, runner.reason


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def agreement(device, sizes: dict, batch: int, n: int = COMPARE) -> dict:
    cuda = device.type == "cuda"
    backend = steps.CudaGraphs(device) if cuda else steps.EagerGraphs()
    batches = _batches(n, batch, device)
    plan = steps.Plan("graph", "graphed", backend=backend)

    def run(kind: str, fused: bool):
        model = _model(sizes, device)
        opt = steps.adam(model.parameters(), 1e-3, device, plan) if fused else \
            torch.optim.Adam(model.parameters(), lr=1e-3)
        return _losses(model, opt, batches, kind, backend if kind == "graphed" else None)

    graphed, path, reason = run("graphed", True)
    same, _, _ = run("static", True)
    plain, _, _ = run("static", False)
    res = {"steps": n, "batch": batch, "graph_path": path, "graph_reason": reason,
           "rel_graph_vs_same_optimizer": _max_rel(graphed, same), "rel_graph_vs_fit_plain_adam": _max_rel(graphed, plain),
           "first_losses": {"graphed": graphed[:5], "same optimizer": same[:5], "plain Adam": plain[:5]},
           "finite": all(math.isfinite(v) for v in graphed + same + plain)}
    res["ok"] = (path == "graphed" and res["finite"] and res["rel_graph_vs_same_optimizer"] <= GRAPH_RTOL
                 and res["rel_graph_vs_fit_plain_adam"] <= FUSED_RTOL)
    return res


def step_runner(model, loss_fn, device, kind: str, log=print):
    """A runner of :mod:`capslib.engine.steps` for training ``model`` on ``loss_fn``: ``kind`` "eager" (plain
    Adam, the step run as written) or "graphed" (fused capturable Adam, the whole step captured in a CUDA graph,
    or eagerly replayed graphs without CUDA); ``log`` receives the graphed runner's lines."""
    sums = steps.StepSums(device)
    if kind == "eager":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    elif kind == "graphed":
        backend = steps.CudaGraphs(device) if device.type == "cuda" else steps.EagerGraphs()
        opt = steps.adam(model.parameters(), 1e-3, device, steps.Plan("graph", "graphed", backend=backend))
    else:
        raise ValueError(f"step_runner: kind must be 'eager' or 'graphed'; got {kind!r}")

    def step(xb, yb):
        return steps.train_step(model, loss_fn, opt, xb, yb, sums)
    if kind == "eager":
        return steps.EagerSteps(step, "eager")
    return steps.GraphedSteps(step, backend, opt, log=log)


def raw_steps(device, sizes: dict, batch: int, n: int) -> dict:
    """Images/s of ``n`` training steps on one fixed batch: the eager step with plain Adam, and the
    graphed step with fused capturable Adam (after 10 steps of warm-up, capture included)."""
    cuda = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.rand(batch, 1, 28, 28, device=device, generator=g)
    y = torch.randint(0, 10, (batch,), device=device, generator=g)
    out = {"batch": batch, "steps": n}
    for kind in ("eager", "graphed"):
        runner = step_runner(_model(sizes, device), capsnet_step_loss, device, kind)
        for _ in range(10):
            runner(x, y)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            runner(x, y)
        if cuda:
            torch.cuda.synchronize()
        out[kind] = {"images_per_s": n * batch / (time.perf_counter() - t0), "path": runner.path,
                     "reason": runner.reason}
    return out


def speed(device, sizes: dict, batch: int, steps_per_epoch: int, amp: bool, fast: bool) -> dict:
    g = torch.Generator(device=device).manual_seed(3)
    n = steps_per_epoch * batch + batch // 2           # a partial last batch: the fast path drops it
    tr = Split(torch.rand(n, 1, 28, 28, device=device, generator=g), torch.randint(0, 10, (n,), device=device, generator=g))
    val = Split(torch.rand(FULL_VAL if device.type == "cuda" else 64, 1, 28, 28, device=device, generator=g),
                torch.randint(0, 10, (FULL_VAL if device.type == "cuda" else 64,), device=device, generator=g))
    model = _model(sizes, device)
    h = train.fit(model, tr, capsnet_step_loss, epochs=2, batch_size=batch, lr=1e-3, lr_decay=0.96, amp=amp, fast=fast,
                  progress=False, seed=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    train.evaluate(model, val, batch_size=1000, amp=amp)   # evaluate ends in host reads: timed to completion
    val_s = time.perf_counter() - t0
    ips = h["images_per_s"][-1]
    return {"amp": amp, "fast": fast, "images_per_s": ips, "first_epoch_images_per_s": h["images_per_s"][0],
            "images_seen": h.get("images_seen", [n, n])[-1], "step_path": h.get("step_path", "eager"),
            "step_path_reason": h.get("step_path_reason"), "validation_s": val_s,
            "epoch_55k_with_validation_s": FULL_EPOCH / ips + val_s * FULL_VAL / len(val),
            "loss": h["loss"], "finite": all(math.isfinite(v) for v in h["loss"])}


def fast_check(steps: int | None = None, device=None) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    sizes = capsnet_sizes(cuda)
    batch = 128 if cuda else 8
    per_epoch = steps or (300 if cuda else 6)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"fast-check on {name}, torch {torch.__version__}" + ("" if cuda else
          ": no GPU here, so tiny sizes and a stand-in for the CUDA graph (a rehearsal; the numbers say nothing)"),
          flush=True)
    out = {"device": name, "torch": torch.__version__, "cuda": cuda, "sizes": {k: list(v) if isinstance(v, tuple) else v
                                                                              for k, v in sizes.items()}}
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        t0 = time.perf_counter()
        agree = agreement(device, sizes, batch, COMPARE if cuda else 8)
        agree["seconds"] = time.perf_counter() - t0
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved
    out["agreement"] = agree
    print(f"agreement over {agree['steps']} steps of batch {batch}: path {agree['graph_path']}"
          + (f" ({agree['graph_reason']})" if agree["graph_reason"] else "")
          + f"; max relative loss difference graph vs same eager steps {agree['rel_graph_vs_same_optimizer']:.2e} "
          f"(limit {GRAPH_RTOL:g}), graph vs fit's plain Adam {agree['rel_graph_vs_fit_plain_adam']:.2e} "
          f"(limit {FUSED_RTOL:g}) -> {'ok' if agree['ok'] else 'FAILED'}", flush=True)
    raw = raw_steps(device, sizes, 100 if cuda else 8, 200 if cuda else 4)
    out["raw_steps"] = raw
    print(f"raw steps, batch {raw['batch']}: eager {raw['eager']['images_per_s']:.0f} img/s, graphed "
          f"{raw['graphed']['images_per_s']:.0f} img/s (path {raw['graphed']['path']}"
          + (f": {raw['graphed']['reason']}" if raw["graphed"]["reason"] else "") + ")", flush=True)
    if cuda:   # the units' settings (capslib.book.ch02.run): TF32 products, cuDNN autotuning
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    rows = []
    for amp in ([False, True] if cuda else [False]):
        for fast in (False, True):
            r = speed(device, sizes, batch, per_epoch, amp, fast)
            rows.append(r)
            print(f"fit {'bf16' if amp else 'fp32'} fast={'on ' if fast else 'off'}: {r['images_per_s']:9.0f} img/s "
                  f"(epoch 1: {r['first_epoch_images_per_s']:.0f}), path {r['step_path']}"
                  + (f" ({r['step_path_reason']})" if r["step_path_reason"] else "")
                  + f", {r['images_seen']} images per epoch; 55k epoch + 5k validation ≈ "
                  f"{r['epoch_55k_with_validation_s']:.2f} s", flush=True)
        off, on = rows[-2], rows[-1]
        print(f"  {'bf16' if amp else 'fp32'}: fast/eager = {on['images_per_s'] / off['images_per_s']:.2f}x", flush=True)
    out["fit"] = rows
    graphed = all(r["step_path"] == "graphed" for r in rows if r["fast"]) if cuda else \
        all(r["step_path"] == "static" for r in rows if r["fast"])
    out["ok"] = bool(agree["ok"] and graphed and raw["graphed"]["path"] == "graphed" and all(r["finite"] for r in rows))
    print("fast-check " + ("passed" if out["ok"] else "FAILED"), flush=True)
    return out
