"""capslib.book.isolate: independent runs in forked processes at one thread, the same numbers however many
run at a time, in process or forked."""
import os
import random

import numpy as np
import pytest
import torch

from capslib.book import isolate, stats


def _train(seed):
    """A small training whose result depends on the seed, the thread count and nothing else."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    x, y = torch.randn(256, 30), torch.randint(0, 3, (256,))
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"seed {seed}: threads {torch.get_num_threads()}")
    return {"loss": loss.item(), "threads": torch.get_num_threads(), "weights": net[0].weight.detach().clone()}


def _in_process_at_one_thread(seed):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(seed)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not isolate.can_fork(), reason="no fork here")
def test_forked_runs_give_the_numbers_of_one_thread_in_process_however_many_run_at_once(capsys):
    seeds = [3, 1, 2]
    expected = [_in_process_at_one_thread(s) for s in seeds]
    capsys.readouterr()
    for workers in (1, 2, 3):
        got = isolate.map_isolated(_train, seeds, workers=workers)
        assert [g["threads"] for g in got] == [1, 1, 1]
        for g, e in zip(got, expected):
            assert g["loss"] == e["loss"]                       # bit for bit
            assert torch.equal(g["weights"], e["weights"])
        # what the runs printed comes back in the items' order, whatever order they ended in
        assert capsys.readouterr().out == "".join(f"seed {s}: threads 1\n" for s in seeds)


def test_the_fallback_in_process_gives_the_same_numbers_and_leaves_the_caller_as_it_was(monkeypatch, capsys):
    seeds = [0, 5]
    expected = [_in_process_at_one_thread(s) for s in seeds]
    monkeypatch.setenv("CAPSBOOK_NO_FORK", "1")
    assert not isolate.can_fork()
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(9)
    before = (torch.rand(1).item(), np.random.rand(), random.random())
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(9)
    threads = torch.get_num_threads()
    got = isolate.map_isolated(_train, seeds, workers=4)
    assert torch.get_num_threads() == threads
    assert (torch.rand(1).item(), np.random.rand(), random.random()) == before   # generators untouched
    assert [g["loss"] for g in got] == [e["loss"] for e in expected]
    assert "seed 0: threads 1\nseed 5: threads 1\n" in capsys.readouterr().out


@pytest.mark.skipif(not isolate.can_fork(), reason="no fork here")
def test_forked_runs_leave_the_callers_generators_and_variables_alone():
    seen = []

    def draw(_):
        seen.append(1)                                          # lost with the child
        return torch.rand(1).item()

    torch.manual_seed(11)
    draws = isolate.map_isolated(draw, [0, 1], workers=2)
    assert draws[0] == draws[1] == torch.rand(1).item()        # each child starts from the caller's state
    assert seen == []


def _fail_on_two(x):
    if x == 2:
        raise ValueError("two is not allowed")
    return x


def _die(_):
    os._exit(3)


@pytest.mark.skipif(not isolate.can_fork(), reason="no fork here")
def test_a_failed_or_dead_run_is_reported_with_its_item():
    with pytest.raises(RuntimeError, match=r"item 2 failed: ValueError: two is not allowed(.|\n)*_fail_on_two"):
        isolate.map_isolated(_fail_on_two, [1, 2, 3], workers=2)
    with pytest.raises(RuntimeError, match="exit code 3"):
        isolate.map_isolated(_die, ["x"], workers=1)
    assert isolate.map_isolated(_fail_on_two, [], workers=2) == []
    with pytest.raises(ValueError, match="workers"):
        isolate.map_isolated(_fail_on_two, [1], workers=0)


@pytest.mark.skipif(not isolate.can_fork(), reason="no fork here")
def test_over_seeds_for_runs_every_key_and_seed_as_one_task_each():
    def fn(key, seed):
        return {"x": key * 10 + seed, "loss": _train(seed)["loss"]}

    serial = stats.over_seeds_for([1, 2], lambda k, s: {"x": k * 10 + s, "loss": _in_process_at_one_thread(s)["loss"]},
                                  [0, 3])
    forked = stats.over_seeds_for([1, 2], fn, [0, 3], isolated=True)
    assert forked[2]["x"].values == (20, 23) and forked[1]["x"].seeds == (0, 3)
    assert all(forked[k]["loss"].values == serial[k]["loss"].values for k in (1, 2))
    with pytest.raises(ValueError, match="distinct"):
        stats.over_seeds_for([1, 1], fn, [0])
