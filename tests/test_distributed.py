"""capslib.train.fit data-parallel over two CPU processes (gloo): the same global batch gives the same
weights as one process, the last batch smaller than the number of ranks included."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from capslib import data, models, train


def _train(n: int, out_path: str | None = None):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(n, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=g)
    net = models.CapsNet(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(8,)).double()

    def step(model, xb, yb):
        out = model(xb, yb)
        return models.capsnet_loss(out, xb, yb), out.lengths

    hist = train.fit(net, data.Split(x, y), step, epochs=2, batch_size=16, lr=1e-2, lr_decay=0.9, seed=3,
                     amp=False, progress=False, augment=data.RandomShift(2, seed=4))
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, hist


def _worker(rank: int, world: int, store: str, n: int, out: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        assert train.distributed_ranks() == (rank, world)
        state, hist = _train(n)
        if rank == 0:
            torch.save({"state": state, "hist": hist}, out)
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_take_the_steps_of_one(tmp_path):
    n = 65   # 4 batches of 16 split 8 + 8, then one of 1: rank 1 gets nothing there
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), n, out), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    assert train.distributed_ranks() is None
    want_state, want_hist = _train(n)
    for k, v in want_state.items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12, msg=k)
    # capsnet_loss adds its terms in float32: per-rank means and the global mean round differently there
    assert got["hist"]["loss"] == pytest.approx(want_hist["loss"], rel=1e-6)
    assert got["hist"]["train_acc"] == want_hist["train_acc"]
    # the weights moved: the comparison is not between two untrained networks
    torch.manual_seed(0)
    init = models.CapsNet(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(8,)).double()
    assert not torch.allclose(init.state_dict()["conv.weight"], want_state["conv.weight"])


def test_init_distributed_without_torchrun_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train.init_distributed().type in ("cpu", "cuda") and train.distributed_ranks() is None
    assert os.environ.get("WORLD_SIZE") is None
