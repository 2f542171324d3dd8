"""Chapter 3's experiment units (capslib.book.ch03): their projection, their training against the
chapter's hand-coded descent, and the write -> load -> view path at smoke size on the CPU."""
import math

import numpy as np
import pytest
import torch

from capslib import data
from capslib import soft_routing as sr
from capslib.book import ch03
from capslib.book import units as U
from capslib.book.stats import signed

SMOKE_KEYS = ("03/routes/M4/s0", "03/routes/M1/s0", "03/ablation/slides/s0", "03/ablation/no-r-in-eta/s0")


def test_every_chapter3_unit_is_declared_and_projected_within_eight_minutes():
    units = U.all_units("03")
    keys = {u.key for u in units}
    assert len(units) == len(ch03.UNIT_ROUTES) * len(ch03.UNIT_SEEDS) + len(ch03.VARIANTS) * len(ch03.ABLATION_SEEDS)
    assert {f"03/routes/M{M}/s{s}" for M in (1, 2, 4, 8) for s in range(5)} <= keys
    assert {f"03/ablation/{ch03.VARIANT_NAMES[v]}/s4" for v in ch03.VARIANTS} <= keys
    for u in units:
        assert U.projected_seconds(u) <= 8 * 60, u.key
        assert u.images == u.config["epochs"] * u.config["train_images"], u.key
    # the main network's first seed runs first, every seed 0 before any seed 1
    assert units[0].key == "03/routes/M4/s0"
    assert max(u.priority for u in units if u.seed == 0) < min(u.priority for u in units if u.seed == 1)
    # no rate measured for this network yet: the projection is the assumed one, and says so
    assert U.rate_of(ch03.UNIT_FAMILY)[1] in ("assumed", "measured")


def test_unit_training_is_the_chapters_hand_coded_descent():
    """``unit_fit`` (autograd, SGD in capslib.train.fit) takes the same steps as the chapter's
    ``train_gd`` (the hand-written gradients) from the same start: same weights after two epochs."""
    unit = U.get("03/routes/M2/s1")
    g = torch.Generator().manual_seed(0)
    x = sr.with_bias(torch.rand(120, 1, 28, 28, generator=g, dtype=torch.float64))
    y = torch.randint(0, 10, (120,), generator=g)
    a, b = ch03.unit_net(unit), ch03.unit_net(unit)
    ch03.unit_fit(unit, a, data.Split(x, y), 2, progress=False)
    sr.train_gd(b, x, y, epochs=2, batch_size=unit.config["batch_size"], lr=unit.config["lr"], seed=unit.seed,
                progress=False)
    assert not torch.equal(a.P, ch03.unit_net(unit).P)          # it trained
    torch.testing.assert_close(a.R, b.R, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(a.P, b.P, rtol=1e-9, atol=1e-12)


def test_probe_sees_what_each_unit_computes():
    p = {k: U.probe_values(U.get(k)) for k in ("03/routes/M4/s0", "03/routes/M4/s3", "03/routes/M8/s0",
                                               "03/ablation/slides/s0", "03/ablation/no-r-in-eta/s0")}
    assert p["03/routes/M4/s0"] == p["03/routes/M4/s3"] == p["03/ablation/slides/s0"]   # the same step
    assert U.fingerprint(U.get("03/routes/M4/s0")) != U.fingerprint(U.get("03/ablation/slides/s0"))  # float64 / 32
    assert not U.probe_agrees(p["03/routes/M8/s0"], p["03/routes/M4/s0"])
    # removing r(j) from the routes' error keeps the energy and changes the routes' gradient
    slides, nor = p["03/ablation/slides/s0"], p["03/ablation/no-r-in-eta/s0"]
    assert nor["energy"] == slides["energy"] and not math.isclose(nor["grad:P"], slides["grad:P"], rel_tol=1e-3)


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory):
    """Smoke runs of two route counts and two ablations, made once: their results folder."""
    root = tmp_path_factory.mktemp("units03")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(U, "RESULTS_ROOT", root)
        for key in SMOKE_KEYS:
            U.execute(U.get(key), device="cpu", smoke=True)
    return root


def test_smoke_results_hold_what_the_views_need(smoke_root, monkeypatch):
    monkeypatch.setattr(U, "RESULTS_ROOT", smoke_root)
    epochs = ch03.UNIT_SMOKE["epochs"]
    for key in SMOKE_KEYS:
        st, res = U.state(U.get(key), smoke=True)
        assert st == "done" and res["smoke"], key
        m, h = res["metrics"], res["history"]
        assert 0 <= m["test_accuracy"] <= 1 and m["test_images"] == ch03.UNIT_SMOKE["test"]
        assert len(h["val_entropy"]) == len(h["val_mi"]) == len(h["energy_per_digit"]) == epochs
        for H in [m["initial"]["entropy_bits"], *h["val_entropy"], m["test_mixing"]["entropy_bits"]]:
            assert -1e-9 <= H <= math.log2(m["routes"]) + 1e-9
        usage = U.decode_array(res["arrays"]["usage_by_epoch"])
        assert usage.shape == (epochs + 1, 10, m["routes"]) and ((usage > 0) & (usage < 1)).all()
    main = U.load("03/routes/M4/s0", smoke=True)
    c = U.decode_array(main["arrays"]["couplings_digit0"])
    assert c.shape == (3, 17, 4) and np.allclose(c.sum(-1), 1, atol=1e-5)       # softmax over the routes
    assert np.allclose(c[0], 0.25)                                               # the first iteration is uniform
    b = main["metrics"]["bridge"]
    assert 0 <= b["same_top"] <= 1 and -1 <= b["pooled_correlation"] <= 1
    assert main["metrics"]["gradient_shares"]["gap_initial"] < main["metrics"]["gradient_shares"]["gap_trained"]
    assert "bridge" not in U.load("03/routes/M1/s0", smoke=True)["metrics"]   # one route: nothing to route


def test_paper_scale_views_from_smoke_results(smoke_root, monkeypatch):
    """Write -> load -> view: the tables and every figure of the chapter's paper-scale section from the
    smoke results, the runs not made named in the banner, "not yet run" where a row has none."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(U, "RESULTS_ROOT", smoke_root)
    rg, ag = ch03.routes_groups(smoke=True), ch03.ablation_groups(smoke=True)
    frame = ch03.routes_frame(rg)
    main = U.load("03/routes/M4/s0", smoke=True)["metrics"]
    assert frame.loc["M = 4", "test accuracy"] == f"{main['test_accuracy']:.4f}" and frame.loc["M = 4", "seeds"] == 1
    assert frame.loc["M = 8", "test accuracy"] == "not yet run" and frame.loc["M = 8", "seeds"] == 0
    one = U.load("03/routes/M1/s0", smoke=True)["metrics"]["test_accuracy"]
    assert frame.loc["M = 4", "minus M = 1 (same seed)"] == signed(main['test_accuracy'] - one, ".4f")   # no sign on 0
    assert frame.loc["M = 8", "parameters"] == sum(p.numel() for p in ch03.unit_net(U.get("03/routes/M8/s0")).parameters())
    abl = ch03.ablation_frame(ag)
    assert abl.loc["the slides' network", "seeds"] == 1 and abl.loc["softmax gate", "entropy lost in epoch 1 (bits)"] == "not yet run"
    assert "no r(j) in η" in abl.index and "no r in eta" not in abl.index     # the reader's names
    text = U.banner(rg + ag)
    assert "1 of 5 seeds run" in text and "M = 8 routes (0 of 5" in text and "03/" not in text
    figs = [ch03.draw_mixing(rg[2].results[0]),
            ch03.draw_bridge(rg[2].results[0]), ch03.draw_routes(rg), ch03.draw_ablation(ag)]
    assert all(f.axes for f in figs)
    plt.close("all")
    with pytest.raises(ValueError, match="at least one"):
        ch03.draw_routes([U.Group("x", "x", [], ["k"], []) for _ in ch03.UNIT_ROUTES])


def _route_result(seed, acc, in_use=1, H=0.01, MI=0.001, top=(2, 2)):
    return {"seed": seed, "metrics": {"test_accuracy": acc, "test_mixing": {"routes_in_use": in_use, "entropy_bits": H,
                                                                           "mutual_information_bits": MI},
                                      "top_route": {"initial": top[0], "final": top[1]}}}


def _group(results):
    return U.Group("x", "x", results, [], [])


def test_paper_scale_summary_counts_seeds_and_pairs_the_route_counts():
    assert "no paper-scale run" in ch03.paper_scale_summary([_group([]) for _ in ch03.UNIT_ROUTES])
    main = [_route_result(0, 0.92), _route_result(1, 0.90, in_use=2, H=0.9, top=(1, 3)), _route_result(2, 0.91)]
    groups = [_group([_route_result(s, 0.90) for s in (0, 1, 2)]), _group([]), _group(main),
              _group([_route_result(0, 0.93), _route_result(1, 0.89)])]     # M = 8: seeds 0 and 1 only
    text = ch03.paper_scale_summary(groups)
    assert "91.00% test accuracy (mean of 3 seeds)" in text
    assert "in 2 of 3 seeds a single route carries" in text and "test digits is at most 0.900 of 2 bits" in text
    assert "in 2 of 3 seeds the route used most at the end is the one whose mean gate was largest" in text
    # M = 8 minus M = 1 on the seeds both have: +0.03 and -0.01, mean +1.00 points
    assert "by +1.00 percentage points (paired by seed, higher in 1 and lower in 1 of 2 seeds)" in text
    assert ch03.paper_scale_short(groups).endswith("through a single route in 2 of 3 seeds")
    groups[2] = _group([_route_result(0, 0.92), _route_result(1, 0.91)])
    assert ch03.paper_scale_short(groups).endswith("through a single route in every one of its seeds")


def test_ablation_summary_reads_each_variant_against_the_slides_with_the_declared_margin():
    def res(seed, H, MI=0.0):
        return {"seed": seed, "metrics": {"final_val_entropy_bits": H, "final_val_mutual_information_bits": MI}}

    assert "no paper-scale run" in ch03.ablation_summary([_group([]) for _ in ch03.VARIANTS])
    slides = _group([res(s, 0.01) for s in range(4)])
    higher = _group([res(s, 0.8 + 0.01 * s) for s in range(4)])                # far above the ±0.1-bit margin
    same = _group([res(s, 0.01 + 0.001 * (-1) ** s) for s in range(4)])          # well inside it
    competitive = _group([res(s, 0.5, MI=0.02 * s) for s in range(4)])
    one_seed = _group([res(0, 0.3)])
    by_variant = {"slides": slides, "no r in eta": higher, "softmax gate": same, "competitive error": competitive,
                  "gates sum to 1": one_seed}
    text = ch03.ablation_summary([by_variant[v] for v in ch03.VARIANTS])
    assert "keeps 0.010 bits of routing entropy on the validation digits (mean of 4 seeds)" in text
    assert "no r(j) in η ends at 0.82 bits, higher, beyond the margin (higher in 4 of 4 seeds)" in text
    assert "softmax gate ends at 0.01 bits, equivalent within ±0.1" in text
    assert "gates sum to 1: 1 paired seed(s), too few to compare" in text
    assert text.endswith("the competitive error's routes carry at most 0.060 bits about the class")


# ----------------------------------------------------------------------------- the small world

def test_specialist_world_gives_each_group_its_own_rule_and_shares_the_rules_between_draws():
    x, y, k = ch03.specialist_world(400, groups=3, dim=5, spread=3.0, seed=0)
    assert x.shape == (400, 6) and y.shape == k.shape == (400,)
    assert torch.all(x[:, -1] == 1)                                   # the constant input
    assert set(k.tolist()) == {0, 1, 2} and set(y.tolist()) == {0, 1}
    # the groups sit `spread` along their own axis: each group's mean is nearest its centre
    centres = 3.0 * torch.eye(3, 5)
    means = torch.stack([x[k == g, :5].mean(dim=0) for g in range(3)])
    assert torch.cdist(means, centres).argmin(dim=1).tolist() == [0, 1, 2]
    # within a group the class is the side of the group's own hyperplane through its centre, in every draw
    rules = ch03.specialist_rules(3, 5)
    assert torch.allclose(rules.norm(dim=1), torch.ones(3))
    for seed in (0, 1):
        xs, ys, ks = ch03.specialist_world(400, groups=3, dim=5, spread=3.0, seed=seed)
        side = ((xs[:, :5] - centres[ks]) * rules[ks]).sum(dim=1) > 0
        assert torch.equal(side.long(), ys)
        # the rules differ from group to group: group 0's hyperplane misreads a share of the others' classes
        own = ((xs[:, :5] - centres[ks]) * rules[0]).sum(dim=1) > 0
        assert float((own.long() == ys)[ks != 0].double().mean()) < 0.9
    with pytest.raises(ValueError, match="dim >= groups"):
        ch03.specialist_world(10, groups=4, dim=3)
    with pytest.raises(ValueError, match="groups >= 2"):
        ch03.specialist_world(10, groups=1)


def test_mean_gate_accuracy_equals_the_accuracy_when_the_gates_do_not_depend_on_the_input():
    x, y, _ = ch03.specialist_world(300, seed=0)
    net = sr.SoftRoutingNet(x.shape[1], 2, 4, init_std=0.5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        net.R.zero_()                                                   # r = 1/2 for every input and route
    assert ch03.mean_gate_accuracy(net, x, y, "slides") == sr.accuracy(net, x, y)
    with torch.no_grad():
        net.R.normal_(generator=torch.Generator().manual_seed(1))      # gates that depend on the input
    assert ch03.mean_gate_accuracy(net, x, y, "slides") != sr.accuracy(net, x, y)


def test_world_run_trains_a_network_whose_routes_follow_the_groups():
    from types import SimpleNamespace

    cfg = SimpleNamespace(world_init_std=0.1, world_epochs=15, world_batch_size=32, world_lr=0.2)
    world = ch03.specialist_world(600, groups=2, dim=4, seed=0)
    test = ch03.specialist_world(600, groups=2, dim=4, seed=1)
    metrics, usage = ch03.world_run("competitive error", 0, world, test, cfg)
    assert set(metrics) == {"accuracy", "mean_gate_accuracy", "entropy0", "entropy", "group_information0",
                            "group_information"}
    assert usage.shape == (2, 2) and np.allclose(usage.sum(axis=1), 1.0)
    assert metrics["group_information0"] < 0.05 < metrics["group_information"]
    assert metrics["accuracy"] > metrics["mean_gate_accuracy"]
    single, usage1 = ch03.world_run("slides", 0, world, test, cfg, routes=1)
    assert single["group_information"] == 0.0 and usage1.shape == (2, 1)
