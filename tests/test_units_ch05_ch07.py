"""Chapters 5 and 7's experiment units (capslib.book.ch05, capslib.book.ch07): their declaration and
projection, what their probes see, the margin that a replayed step still raises, and the write -> load
-> view path at smoke size on the CPU (one unit per chapter)."""
import math

import numpy as np
import pytest
import torch

from capslib import em
from capslib.book import ch05, ch07
from capslib.book import units as U


def test_every_unit_is_declared_and_projected_within_eight_minutes():
    u5, u7 = U.all_units("05"), U.all_units("07")
    keys5, keys7 = {u.key for u in u5}, {u.key for u in u7}
    assert len(u5) == (1 + len(ch05.UNIT_STUDY_SCHEDULES) * len(ch05.UNIT_ITERATIONS)) * len(ch05.UNIT_SEEDS)
    assert {f"05/iterations/{s}/T{T}/s{k}" for s in ("authors", "constant") for T in (1, 2, 3) for k in (0, 1, 2)} <= keys5
    assert {"05/main/s0", "05/main/s1", "05/main/s2"} <= keys5
    assert keys7 == {f"07/experts/{v}/s{k}" for v in ("hauser", "centred", "sparsity", "both") for k in (0, 1, 2)}
    for u in u5 + u7:
        assert U.projected_seconds(u) <= 8 * 60, u.key
    for u in u5:
        assert u.images == u.config["epochs"] * u.config["train_images"], u.key
    # the most valuable first: the main network, then one seed of every configuration before any second seed
    assert u5[0].key == "05/main/s0"
    for units in (u5, u7):
        assert max(u.priority for u in units if u.seed == 0) < min(u.priority for u in units if u.seed == 1)
    assert U.rate_of(ch05.UNIT_FAMILY)[1] in ("bench", "measured")
    assert U.rate_of(ch07.UNIT_FAMILY)[1] in ("assumed", "measured")   # CD-1 and U have no bench rate yet
    # the shortened schedules are in the configurations, beside the longer ones they stand for
    assert u5[0].config["epochs"] < u5[0].config["paper_epochs"]
    full = u7[0].config["full_epochs"]
    assert u7[0].config["cd_epochs"] < full["cd"] and u7[0].config["ae_epochs"] < full["ae"]


def test_the_authors_schedule():
    lam = em.inverse_temperatures(3, 0.01, "authors")
    assert lam == pytest.approx([0.01 * (1 - 0.95 ** (t + 1)) for t in range(3)])
    assert em.inverse_temperatures(2, 0.01, "authors") == lam[:2]          # iteration t does not depend on T
    # em_trace follows the schedule it is given: its last state is em_routing's
    g = torch.Generator().manual_seed(0)
    V, a = torch.randn(2, 6, 3, 4, generator=g, dtype=torch.float64), torch.rand(2, 6, generator=g, dtype=torch.float64)
    mu, act, _ = em.em_routing(V, a, 0.0, 0.0, 3, final_lambda=0.01, normalize="none", schedule="authors")
    last = em.em_trace(V, a, 0.0, 0.0, 3, final_lambda=0.01, normalize="none", schedule="authors")[-1]
    torch.testing.assert_close(last.mu, mu)
    torch.testing.assert_close(last.a, act)


def test_the_margin_rises_with_a_counter_on_the_device():
    loss = ch05.CountedSpreadLoss(5, 0.2, 0.9, device="cpu")
    net = em_out
    x, y = torch.zeros(3, 1), torch.tensor([0, 1, 2])
    margins = []
    for _ in range(7):
        margins.append(float(loss.margin()))
        loss(net, x, y)
    assert margins == pytest.approx([em.margin_at(s, 5, 0.2, 0.9) for s in range(7)])


def em_out(x):
    from capslib.em_layers import EMOutput
    a = torch.tensor([[0.7, 0.6, 0.1], [0.2, 0.5, 0.1], [0.3, 0.3, 0.3]])
    return EMOutput(a, torch.zeros(3, 3, 4, 4))


def test_probes_see_what_each_unit_computes():
    p = {k: U.probe_values(U.get(k)) for k in ("05/main/s0", "05/main/s2", "05/iterations/constant/T3/s0",
                                               "05/iterations/constant/T1/s0", "05/iterations/authors/T3/s0")}
    assert p["05/main/s0"] == p["05/main/s2"]                                  # seeds train the same network
    for a, b in [("05/main/s0", "05/iterations/constant/T3/s0"), ("05/iterations/constant/T3/s0", "05/iterations/constant/T1/s0"),
                 ("05/iterations/constant/T3/s0", "05/iterations/authors/T3/s0")]:
        assert not U.probe_agrees(p[a], p[b]), (a, b)
    q = {v: U.probe_values(U.get(f"07/experts/{v}/s0")) for v in ch07.UNIT_VARIANTS}
    assert q["hauser"]["ae_loss"] == q["centred"]["ae_loss"] == q["sparsity"]["ae_loss"]   # the same autoencoder step
    assert q["hauser"]["delta_U"] == q["sparsity"]["delta_U"]                 # the sparsity term acts on W only
    assert not math.isclose(q["hauser"]["delta_W"], q["sparsity"]["delta_W"], rel_tol=1e-3)
    assert not math.isclose(q["hauser"]["delta_W"], q["centred"]["delta_W"], rel_tol=1e-3)
    for other in ("centred", "sparsity"):                                    # both: centring and the sparsity term
        assert not math.isclose(q["both"]["delta_W"], q[other]["delta_W"], rel_tol=1e-3)
    assert q["both"]["delta_U"] == q["centred"]["delta_U"]                    # U sees the centred capsules
    assert U.fingerprint(U.get("07/experts/hauser/s0")) != U.fingerprint(U.get("07/experts/centred/s0"))


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("units0507")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(U, "RESULTS_ROOT", root)
        for key in ("05/main/s0", "07/experts/both/s0"):
            U.execute(U.get(key), device="cpu", smoke=True)
    return root


def test_chapter5_views_from_a_smoke_result(smoke_root, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(U, "RESULTS_ROOT", smoke_root)
    st, res = U.state(U.get("05/main/s0"), smoke=True)
    assert st == "done" and res["smoke"]
    m = res["metrics"]
    assert m["test_images"] == ch05.UNIT_SMOKE["test"] and m["nonfinite_losses"] == 0
    assert m["final_margin"] == pytest.approx(0.9)                        # the margin reached its end
    assert m["step_path"] == "static"                                      # the fast path on a CPU
    sh = m["sharpening"]
    assert len(sh["assignment_entropy_nats"]) == 3 and all(0 <= h <= math.log(10) + 1e-6 for h in sh["assignment_entropy_nats"])
    assert set(m["viewpoint"]) == {str(a) for a in ch05.VIEWPOINT_ANGLES} and m["viewpoint"]["0"] == m["test_accuracy"]
    assert 0 <= m["pitfall"]["renormalised_test_accuracy"] <= 1       # the pitfall switched on, then off again
    ht, ho = U.decode_array(res["arrays"]["fig2_true"]), U.decode_array(res["arrays"]["fig2_other"])
    assert ht.shape == ho.shape == (3, ch05.FIG2_BINS)
    assert (ht >= 0).all() and (ho >= 0).all() and 0 < ht.sum() and 0 < ho.sum()
    mg, ig = ch05.main_groups(smoke=True), ch05.iteration_groups(smoke=True)
    frame = ch05.main_frame(mg)
    assert frame.loc["MNIST test digits, 28x28", "test error (%)"] == f"{100 * m['test_error']:.2f}"
    assert frame.loc["MNIST test digits, the renormalisation pitfall switched on", "test error (%)"] == \
        f"{100 * (1 - m['pitfall']['renormalised_test_accuracy']):.2f}"
    assert frame["seeds"].iloc[0] == 1
    it = ch05.iterations_frame(ig)
    assert (it["test error (%)"] == "not yet run").all() and (it["seeds"] == 0).all()
    text = U.banner(mg + list(ig.values()))
    assert "1 of 3 seeds run" in text and "0 of 3 seeds run" in text and "05/" not in text
    figs = [ch05.draw_curves(mg[0].results), ch05.draw_fig2(mg[0].results[0])]
    assert all(f.axes for f in figs)
    with pytest.raises(ValueError, match="at least one"):
        ch05.draw_iterations(ig)
    plt.close("all")
    # the comparison table's paper-scale column: the MNIST rows (the paper's number is smallNORB's, with none here)
    assert U.paper_scale_cell("hinton_smallnorb_error", smoke=True) is None
    assert U.paper_scale_cell("—", smoke=True, quantity="MNIST test error, 3 iterations") == \
        f"{m['test_error']:.2%} (1 of 3 seeds)"
    assert U.paper_scale_cell("—", smoke=True, quantity="affNIST-style test error, 3 iterations") == \
        f"{1 - m['transfer']['affine_40']:.1%} (1 of 3 seeds)"
    assert U.paper_scale_cell("—", smoke=True, quantity="MNIST test error, iteration comparison, T = 2") == "not yet run"


def test_chapter7_views_from_a_smoke_result(smoke_root, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(U, "RESULTS_ROOT", smoke_root)
    st, res = U.state(U.get("07/experts/both/s0"), smoke=True)
    assert st == "done" and res["smoke"]
    m = res["metrics"]
    J, n = ch07.UNIT_SCHEDULE["out_caps"], ch07.UNIT_SMOKE["purity_samples"]
    p = m["purity"]
    assert len(p["per_capsule"]) == len(p["majority"]) == J and p["samples_per_capsule"] == n
    assert all(1 / 10 <= q <= 1 for q in p["per_capsule"]) and 1 <= p["distinct_classes"] <= 10
    assert 0 <= m["readout"]["capsules"] <= 1 and 0 <= m["collapse"]["resultant_min"] <= 1 + 1e-6
    r = m["division"]                                  # each training digit given to the expert that fires most for it
    assert 1 <= r["experts"] <= J and len(r["majority"]) == J and 0 < r["shuffled"] <= r["purity"] + 0.2 and r["purity"] <= 1
    assert len(res["history"]["cd_reconstruction"]) == ch07.UNIT_SMOKE["cd_epochs"]
    samples = U.decode_array(res["arrays"]["samples"])
    assert samples.shape == (J, ch07.UNIT_SMOKE["shown_samples"], 28, 28) and samples.dtype == np.uint8
    groups = ch07.experts_groups(smoke=True)
    frame = ch07.experts_frame(groups)
    row = ch07.VARIANT_LABELS["both"]
    assert frame.loc[row, "class purity"] == f"{p['mean']:.3f}" and frame.loc[row, "seeds"] == 1
    assert frame.loc[row, "winner purity"] == f"{r['purity']:.3f}"
    assert frame.loc["sparsity term", "class purity"] == "not yet run"
    assert "1 of 3 seeds run" in U.banner(groups)
    figs = [ch07.draw_samples(groups[3].results[0]), ch07.draw_purity(groups)]
    assert all(f.axes for f in figs)
    plt.close("all")


def test_division_of_labour_reads_the_partition_of_the_winning_experts():
    # three experts; expert 0 wins the 0s and 1s, expert 2 the 2s, expert 1 nothing
    labels = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    lengths = torch.full((8, 3), 0.1)
    lengths[:4, 0] = 0.9
    lengths[4:, 2] = 0.8
    d = ch07.division_of_labour(lengths, labels, shuffles=50)
    assert d["winner"].tolist() == [0, 0, 0, 0, 2, 2, 2, 2] and d["experts"] == 2
    assert d["purity"] == pytest.approx((3 + 4) / 8) and d["majority"] == [0, -1, 2]
    assert d["shuffled"] < d["purity"]                   # shuffled labels mix the two groups
    one = ch07.division_of_labour(torch.ones(8, 3) * torch.tensor([0.1, 0.9, 0.2]), labels, shuffles=5)
    assert one["experts"] == 1 and one["purity"] == pytest.approx(4 / 8) == pytest.approx(one["shuffled"])
    with pytest.raises(ValueError, match="lengths must be"):
        ch07.division_of_labour(lengths, labels[:3])
    with pytest.raises(ValueError, match="shuffles"):
        ch07.division_of_labour(lengths, labels, shuffles=0)


def test_firing_pattern_counts_the_experts_on_for_each_image():
    # image 0: one expert on (0.9 of 1.2 in all); image 1: every expert weakly on-ish but none past 1/2;
    # image 2: two experts on; image 3: all off, the winner 0.4 against a runner-up of 0.2
    lengths = torch.tensor([[0.9, 0.2, 0.1], [0.45, 0.45, 0.3], [0.8, 0.6, 0.0], [0.4, 0.2, 0.2]])
    f = ch07.firing_pattern(lengths)
    assert f["on"] == pytest.approx(3 / 12)
    assert f["one_on"] == pytest.approx(1 / 4)
    assert f["winner_share"] == pytest.approx((0.9 / 1.2 + 0.45 / 1.2 + 0.8 / 1.4 + 0.4 / 0.8) / 4)
    assert f["runner_up"] == pytest.approx((0.2 / 0.9 + 1.0 + 0.6 / 0.8 + 0.5) / 4)
    # a generated code of Fig. 2: one capsule at squash(g)'s length, the others 0
    lone = torch.zeros(5, 20)
    lone[:, 3] = 0.93
    g = ch07.firing_pattern(lone)
    assert g["one_on"] == 1.0 and g["winner_share"] == pytest.approx(1.0) and g["runner_up"] == 0.0
    # equal lengths: each holds 1 / J
    assert ch07.firing_pattern(torch.full((4, 20), 0.1))["winner_share"] == pytest.approx(1 / 20)
    with pytest.raises(ValueError, match="lengths must be"):
        ch07.firing_pattern(torch.ones(3))
    with pytest.raises(ValueError, match="non-negative"):
        ch07.firing_pattern(-torch.ones(3, 2))


def test_part_pose_world_agrees_under_the_true_transforms_and_clutters_a_share_of_parts():
    """Chapter 5's small world: without noise or clutter, every part's vote under W_tk = P_tk is the object's
    pose (the votes for the true class agree exactly, those for another class do not); clutter replaces about the
    share asked for; bad arguments are refused."""
    P = ch05.part_transforms(5, 8)
    M, y = ch05.part_pose_world(50, P, outliers=0.0, noise=0.0, seed=3)
    assert M.shape == (50, 8, 4, 4) and y.shape == (50,)
    votes = torch.stack([M[:, t] @ P[t, y] for t in range(8)], 1)            # (n, parts, 4, 4)
    torch.testing.assert_close(votes, votes[:, :1].expand_as(votes), atol=1e-5, rtol=0)
    other = (y + 1) % 5
    wrong = torch.stack([M[:, t] @ P[t, other] for t in range(8)], 1)
    assert float((wrong - wrong[:, :1]).abs().amax(dim=(1, 2, 3)).min()) > 0.1
    Mc, yc = ch05.part_pose_world(400, P, outliers=0.3, noise=0.0, seed=3)
    clean = torch.stack([Mc[:, t] @ P[t, yc] for t in range(8)], 1)
    centre = clean.median(dim=1).values[:, None]
    share = float(((clean - centre).abs().amax(dim=(2, 3)) > 1e-3).float().mean())
    assert 0.2 < share < 0.4
    with pytest.raises(ValueError, match="outliers"):
        ch05.part_pose_world(5, P, outliers=1.0, noise=0.0, seed=0)


def test_a_turned_world_keeps_its_votes_in_agreement_and_its_training_objects_within_the_familiar_range():
    """The viewpoint test's data: objects drawn within +-max_degrees; a turn left-multiplies every part of an
    example by one rotation of +-degrees (so the true class's votes under W_tk = P_tk still agree, at the turned
    object pose), the same sign for every part and angle of an example; bad ranges are refused."""
    P = ch05.part_transforms(5, 8)
    M, y = ch05.part_pose_world(300, P, outliers=0.0, noise=0.0, seed=4, max_degrees=60)
    O = M[:, 0] @ P[0, y]                                                      # each object's pose
    angle = torch.rad2deg(torch.atan2(O[:, 1, 0], O[:, 0, 0]))
    assert float(angle.abs().max()) <= 60 + 1e-3 and float(angle.abs().max()) > 50
    assert torch.equal(ch05.turn_poses(M, 0, seed=1), M)
    T = ch05.turn_poses(M, 90, seed=7)
    votes = torch.stack([T[:, t] @ P[t, y] for t in range(8)], 1)
    torch.testing.assert_close(votes, votes[:, :1].expand_as(votes), atol=1e-5, rtol=0)
    turned = torch.rad2deg(torch.atan2(votes[:, 0, 1, 0], votes[:, 0, 0, 0])) - angle
    turned = (turned + 180) % 360 - 180
    assert torch.allclose(turned.abs(), torch.full_like(turned, 90.0), atol=1e-3)
    assert 0.3 < float((turned > 0).float().mean()) < 0.7                     # either way, at random
    torch.testing.assert_close(ch05.turn_poses(ch05.turn_poses(M, 30, seed=7), 30, seed=7),
                               ch05.turn_poses(M, 60, seed=7), atol=1e-5, rtol=0)
    # the default range is the whole circle and draws exactly the world of the iteration study
    full, y_full = ch05.part_pose_world(20, P, outliers=0.3, noise=0.05, seed=9)
    same, y_same = ch05.part_pose_world(20, P, outliers=0.3, noise=0.05, seed=9, max_degrees=180)
    assert torch.equal(full, same) and torch.equal(y_full, y_same)
    with pytest.raises(ValueError, match="max_degrees"):
        ch05.part_pose_world(5, P, outliers=0.0, noise=0.0, seed=0, max_degrees=200)


def test_train_to_match_keeps_the_first_epoch_that_reaches_the_target_or_the_best():
    """The matched-accuracy protocol: a reachable target stops the training at the first epoch that reaches it, with
    that epoch's weights; an unreachable one trains every epoch and keeps the best epoch's weights."""
    from capslib import data, train
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 2, 4, 4, generator=g)
    y = (x[:, 0, 0, 0] > 0).long()
    split = data.Split(x, y)

    def run(target, epochs):
        torch.manual_seed(0)
        net = ch05.PoseMLP(2, 2, 8)
        e, acc = ch05.train_to_match(net, split, ch05.cross_entropy_step, target, val=split, epochs=epochs,
                                     batch_size=32, lr=1e-2, seed=0)
        return net, e, acc

    net, e, acc = run(0.0, 5)
    assert e == 1 and acc == pytest.approx(train.evaluate(net, split))
    net, e, acc = run(2.0, 4)                                                  # never reached: the best of 4
    torch.manual_seed(0)
    h = train.fit(ch05.PoseMLP(2, 2, 8), split, ch05.cross_entropy_step, epochs=4, batch_size=32, lr=1e-2, val=split,
                  seed=0, progress=False)
    assert acc == max(h["val_acc"]) and e == h["val_acc"].index(acc) + 1
    assert acc == pytest.approx(train.evaluate(net, split))


def test_world_trace_ends_where_the_trained_layer_ends():
    """Chapter 5's iteration-by-iteration read-out of a small-world network: one entry per routing iteration, and
    the last iteration's activations are the network's own output."""
    from types import SimpleNamespace
    cfg = SimpleNamespace(**{**ch05.WORLD, "world_epochs": 1})
    P = ch05.part_transforms(cfg.world_classes, cfg.world_parts)
    x, y = ch05.part_pose_world(200, P, cfg.world_outliers, cfg.world_noise, seed=5)
    net = ch05.world_net(3, "constant", 0, cfg, (x, y))
    trace = ch05.world_trace(net, x, y)
    assert all(len(v) == 3 for v in trace.values())
    with torch.no_grad():
        act = net.eval()(x).activations
    true = torch.nn.functional.one_hot(y, cfg.world_classes).bool()
    assert trace["a_true"][-1] == pytest.approx(float(act[true].mean()), abs=1e-6)
    assert trace["a_other"][-1] == pytest.approx(float(act[~true].mean()), abs=1e-6)
