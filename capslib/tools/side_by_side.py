"""``python -m capslib.tools.side_by_side``: capslib's training steps timed against two public implementations.

    python -m capslib.tools.side_by_side --peers .gpu/peers --out book/results/bench/side_by_side.json [--rounds 8]

The peers are XifengGuo/CapsNet-Pytorch (a CapsNet) and yl-1993/Matrix-Capsules-EM-PyTorch (EM capsules), the
two implementations issue 30's targets are stated against. Their working trees go under
``PEERS/CapsNet-Pytorch`` and ``PEERS/Matrix-Capsules-EM-PyTorch``: ``make peers`` exports them from the git
mirrors a session's ``fetch`` tool makes, into ``.gpu/peers`` (git-ignored; it travels to a lent GPU with the
rest of ``.gpu``). They are run, never copied into this repository.

Everything runs in one process on one device. Each case is a callable of ``steps`` training steps (forward,
backward, Adam) on one fixed batch, and the cases are timed against each other in interleaved rounds
(:func:`capslib.book.timing.interleaved_seconds`, the device synchronised around every call), so that a
neighbour slowing the machine slows every case of a round alike:

- **CapsNet** at the paper's size (chapter 2's ``full`` network), batch 100: the peer with its own loss (margin
  plus 0.392 times the mean squared pixel error, which is 0.0005 times the summed one, as its script trains);
  capslib eager with plain Adam; capslib's fast step, fused capturable Adam with the whole step captured in a
  CUDA graph (:class:`capslib.engine.steps.GraphedSteps`, what ``fit(fast=True)`` and chapter 2's units run).
- **EM capsules**, A = B = C = D = 32, K = 3, 4x4 poses, 3 iterations, batch 32: the peer, capslib eager and
  capslib's fast step, all scored by capslib's spread loss (margin 0.5).

Reported per case: images/s (median over the rounds, and the lowest and highest), the parameter count, the step
path taken (a capture that fails falls back to the eager step and says why); per capslib case its ratio to the
peer's median; and issue 30's targets (CapsNet at least 5 times the peer, EM at least 15 times), met or not.
Without CUDA it runs tiny stand-ins (the peers' ``.cuda()`` calls made no-ops for the run): a rehearsal of
the code path whose numbers say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from ..book.timing import interleaved_seconds
from ..em import spread_loss
from ..em_layers import EMCapsNet
from ..models import CapsNet
from .fast_check import capsnet_sizes, capsnet_step_loss, step_runner

PEERS = {"capsnet": "CapsNet-Pytorch", "em": "Matrix-Capsules-EM-PyTorch"}
TARGETS = {"capsnet": 5.0, "em": 15.0}      # issue 30: capslib's fast step against the peer, images/s
SIZES = {   # (CUDA, CPU rehearsal): batch and steps per timed call; the EM widths
    "capsnet": {True: dict(batch=100, steps=10), False: dict(batch=2, steps=1)},
    "em": {True: dict(batch=32, steps=4, width=32), False: dict(batch=2, steps=1, width=4)},
}
SPREAD_MARGIN = 0.5


@contextlib.contextmanager
def _peers_on(peers: Path, cuda: bool):
    """The peers importable (their folders first on ``sys.path``; a stand-in ``torchvision`` where none is
    installed, which one peer imports at the top for its data loaders); without CUDA their ``.cuda()`` calls
    and ``torch.cuda.FloatTensor`` made to work on the CPU. Everything is put back afterwards."""
    missing = [PEERS[k] for k in PEERS if not (peers / PEERS[k]).is_dir()]
    if missing:
        raise FileNotFoundError(f"{peers}: no {', '.join(missing)} here (make peers exports them)")
    saved_path, before = list(sys.path), set(sys.modules)
    stubbed = False
    saved = (torch.Tensor.cuda, torch.nn.Module.cuda, getattr(torch.cuda, "FloatTensor", None))
    sys.path[:0] = [str(peers / PEERS["capsnet"]), str(peers / PEERS["em"])]
    if importlib.util.find_spec("torchvision") is None:
        stub = types.ModuleType("torchvision")
        stub.transforms = stub.datasets = None
        sys.modules["torchvision"] = stub
        stubbed = True
    if not cuda:
        torch.Tensor.cuda = lambda self, *a, **k: self
        torch.nn.Module.cuda = lambda self, *a, **k: self
        torch.cuda.FloatTensor = lambda *shape: torch.empty(*shape)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        root = str(peers.resolve())
        for name in set(sys.modules) - before:   # the peers' modules only (torch's own, imported meanwhile, stay)
            where = getattr(sys.modules[name], "__file__", None) or ""
            if str(Path(where).resolve()).startswith(root) or (stubbed and name == "torchvision"):
                del sys.modules[name]
        torch.Tensor.cuda, torch.nn.Module.cuda = saved[0], saved[1]
        if saved[2] is None:
            with contextlib.suppress(AttributeError):
                del torch.cuda.FloatTensor
        else:
            torch.cuda.FloatTensor = saved[2]


def _em_loss(model, x, y):
    a = model(x).activations
    return spread_loss(a.float(), y, SPREAD_MARGIN), a


def _case(model: torch.nn.Module, loss_fn, batch: tuple, n: int, device, kind: str):
    """A callable of ``n`` training steps on ``batch`` and its runner: ``kind`` is "peer" or "eager" (plain
    Adam, eager) or "fast" (fused capturable Adam, the step captured in a CUDA graph)."""
    x, y = batch
    runner = step_runner(model, loss_fn, device, "graphed" if kind == "fast" else "eager", log=lambda line: None)

    def call():
        for _ in range(n):
            runner(x, y)
    return call, runner


def _peer_models(em_width: int):
    from capsulenet import CapsuleNet, caps_loss          # XifengGuo/CapsNet-Pytorch
    from model.capsules import CapsNet as PeerEM           # yl-1993/Matrix-Capsules-EM-PyTorch

    def peer_capsnet_loss(model, x, y):
        onehot = F.one_hot(y, 10).float()
        lengths, recon = model(x, onehot)
        return caps_loss(onehot, lengths, x, recon, 0.392), lengths

    def peer_em_loss(model, x, y):
        a = model(x)
        return spread_loss(a.float(), y, SPREAD_MARGIN), a
    torch.manual_seed(0)
    capsnet = CapsuleNet(input_size=[1, 28, 28], classes=10, routings=3)
    torch.manual_seed(0)
    em = PeerEM(A=em_width, B=em_width, C=em_width, D=em_width, E=10, K=3, P=4, iters=3)
    return (capsnet, peer_capsnet_loss), (em, peer_em_loss)


def measure(peers: Path, rounds: int = 8, device: torch.device | None = None) -> dict:
    """Time the cases (see the module) and return the report."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu (rehearsal: tiny stand-ins)",
              "torch": torch.__version__, "rounds": rounds, "measured": time.strftime("%Y-%m-%d %H:%M"),
              "groups": {}}
    with _peers_on(peers, cuda):
        width = SIZES["em"][cuda]["width"]
        (peer_caps, peer_caps_loss), (peer_em, peer_em_loss) = _peer_models(width)
        builders = {
            "capsnet": (peer_caps, peer_caps_loss, lambda: CapsNet(**capsnet_sizes(cuda)), capsnet_step_loss),
            "em": (peer_em, peer_em_loss,
                   lambda: EMCapsNet(A=width, B=width, C=width, D=width, classes=10, iterations=3), _em_loss)}
        for group, (peer, peer_loss, build, loss_fn) in builders.items():
            size = SIZES[group][cuda]
            g = torch.Generator().manual_seed(3)
            batch = (torch.rand(size["batch"], 1, 28, 28, generator=g).to(device),
                     torch.randint(0, 10, (size["batch"],), generator=g).to(device))
            models = {"peer": peer.to(device)}
            for kind in ("eager", "fast"):
                torch.manual_seed(0)
                models[kind] = build().to(device)
            cases = {kind: _case(m, peer_loss if kind == "peer" else loss_fn, batch, size["steps"], device, kind)
                     for kind, m in models.items()}
            secs = interleaved_seconds({k: c[0] for k, c in cases.items()}, rounds=rounds,
                                       device=device if cuda else None)
            images = size["batch"] * size["steps"]
            rows = {}
            for kind, s in secs.items():
                rates = [images / t for t in s]
                runner = cases[kind][1]
                rows[kind] = {"images_per_s": statistics.median(rates), "lowest": min(rates), "highest": max(rates),
                              "parameters": sum(p.numel() for p in models[kind].parameters()),
                              "path": runner.path, "reason": runner.reason}
            for kind in ("eager", "fast"):
                rows[kind]["times_peer"] = rows[kind]["images_per_s"] / rows["peer"]["images_per_s"]
            report["groups"][group] = {"peer": PEERS[group], "batch": size["batch"], "steps_per_call": size["steps"],
                                       "cases": rows, "target_times_peer": TARGETS[group],
                                       "target_met": rows["fast"]["times_peer"] >= TARGETS[group] if cuda else None}
            del models, cases
            if cuda:
                torch.cuda.empty_cache()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m capslib.tools.side_by_side", description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=Path, default=Path(".gpu/peers"), help="the peers' working trees (make peers)")
    ap.add_argument("--out", type=Path, required=True, help="the report (JSON)")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        report = measure(a.peers, a.rounds)
    except FileNotFoundError as err:
        ap.error(str(err))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    for group, g in report["groups"].items():
        line = ", ".join(f"{k} {c['images_per_s']:,.0f}" + (f" ({c['times_peer']:.2f}x)" if "times_peer" in c else "")
                         for k, c in g["cases"].items())
        print(f"{group} (batch {g['batch']}, images/s): {line}; target {g['target_times_peer']:g}x the peer: "
              f"{ {True: 'met', False: 'not met', None: 'not judged (CPU rehearsal)'}[g['target_met']]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
