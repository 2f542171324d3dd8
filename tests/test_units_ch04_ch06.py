"""Chapters 4 and 6's experiment units (capslib.book.ch04, capslib.book.ch06): their declaration and
projection, what their probes see, and the write -> load -> view path at smoke size on the CPU."""
import math

import numpy as np
import pytest

from capslib.book import ch04, ch06
from capslib.book import units as U


def test_every_unit_is_declared_and_projected_within_eight_minutes():
    u4, u6 = U.all_units("04"), U.all_units("06")
    assert {u.key for u in u4} == {f"04/{d}/{v}/s{s}" for d in ("mnist", "expanded") for v in ch04.UNIT_VARIANTS
                                   for s in ch04.UNIT_SEEDS}
    assert {u.key for u in u6} == {f"06/{k}/s{s}" for k in ("vanilla", "pruned") for s in ch06.UNIT_SEEDS}
    for u in u4 + u6:
        assert U.projected_seconds(u) <= 8 * 60, u.key
        assert u.images >= u.config["epochs"] * u.config["train_images"], u.key
    # Table 1's length on 28x28 digits; the expanded runs' shorter schedule is in their configuration
    assert {u.config["epochs"] for u in u4 if u.name.startswith("mnist")} == {ch04.PAPER_EPOCHS}
    assert {u.config["epochs"] for u in u4 if u.name.startswith("expanded")} == {ch04.UNIT_EXPANDED["epochs"]}
    # one seed of every configuration runs before any second seed
    for units in (u4, u6):
        assert max(u.priority for u in units if u.seed == 0) < min(u.priority for u in units if u.seed == 1)
    assert u4[0].key == "04/mnist/full/s0" and u6[0].key == "06/vanilla/s0"


def test_probes_differ_where_the_computation_differs():
    p = {k: U.probe_values(U.get(k)) for k in ("04/mnist/full/s0", "04/mnist/full/s3", "04/mnist/detached/s0",
                                               "04/mnist/uniform/s0", "06/vanilla/s0", "06/pruned/s0")}
    assert p["04/mnist/full/s0"] == p["04/mnist/full/s3"]                       # the seed is not in the step
    full, det, uni = p["04/mnist/full/s0"], p["04/mnist/detached/s0"], p["04/mnist/uniform/s0"]
    # detaching keeps the forward pass (the loss) and changes the gradient of W (little at initialisation,
    # where the votes are short, but far beyond the probe's tolerance); one iteration changes both
    assert det["loss"] == pytest.approx(full["loss"], rel=1e-12)
    assert not math.isclose(det["grad:digit.W"], full["grad:digit.W"], rel_tol=1e-5)
    assert not U.probe_agrees(det, full) and not U.probe_agrees(uni, full)
    assert not math.isclose(uni["loss"], full["loss"], rel_tol=1e-9)     # float64: short votes, small change
    # the pruned unit's step adds LOBSTER's shrinkage to the same gradient step as the vanilla one
    v, r = p["06/vanilla/s0"], p["06/pruned/s0"]
    assert {k: r[k] for k in v} == v and any(k.startswith("shrink:") and r[k] > 0 for k in r)
    assert U.fingerprint(U.get("06/vanilla/s0")) != U.fingerprint(U.get("06/pruned/s0"))


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("units0406")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(U, "RESULTS_ROOT", root)
        for key in ("04/mnist/full/s0", "06/pruned/s0"):
            U.execute(U.get(key), device="cpu", smoke=True)
    return root


def test_chapter4_smoke_result_and_views(smoke_root, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(U, "RESULTS_ROOT", smoke_root)
    st, res = U.state(U.get("04/mnist/full/s0"), smoke=True)
    assert st == "done" and res["smoke"]
    m, r = res["metrics"], res["metrics"]["test_routing"]
    assert 0 <= m["test_accuracy"] <= 1 and m["test_images"] == ch04.UNIT_SMOKE["test"]
    assert r["accuracy_routed"] == pytest.approx(m["test_accuracy"])             # the same forward pass
    assert 0 <= r["row_entropy_nats"] <= math.log(10) + 1e-6 and r["v_change_mean"] > 0
    assert 0 < m["second_term"]["ratio"] < 1 and m["step_path"] in ("static", "graphed")
    by_epoch = res["history"]["coupling_by_epoch"]
    assert by_epoch["epoch"] == [0, 1] and by_epoch["rel_diff"][0] < by_epoch["rel_diff"][1]
    assert U.decode_array(res["arrays"]["test_coupling_hist"]).sum() == m["test_images"] * 10 * (
        ch04.UNIT_SMOKE["capsnet"]["primary_types"] * 36)
    groups = ch04.unit_groups("mnist", smoke=True)
    frame = ch04.variants_frame(groups)
    assert frame.loc["full gradient", "test accuracy"] == f"{m['test_accuracy']:.4f}"
    assert frame.loc["detached couplings", "test accuracy"] == "not yet run"
    assert "1 of 5 seeds run" in U.banner(groups) and "04/" not in U.banner(groups)
    figs = [ch04.draw_training(groups), ch04.draw_couplings(groups)]
    assert all(f.axes for f in figs)
    plt.close("all")
    with pytest.raises(ValueError, match="at least one"):
        ch04.draw_training(ch04.unit_groups("expanded", smoke=True))


def test_chapter6_smoke_result_and_views(smoke_root, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(U, "RESULTS_ROOT", smoke_root)
    st, res = U.state(U.get("06/pruned/s0"), smoke=True)
    assert st == "done" and res["smoke"]
    m = res["metrics"]
    path = m["rem_sparsity_by_epoch"]
    assert len(path) == ch06.UNIT_SMOKE["epochs"]
    for name in ch06.UNIT_METHODS:
        at = m[name]["by_K"]
        assert set(at) == {str(k) for k in ch06.UNIT_LEVELS}
        assert 0 <= at["11"]["entropy"] <= at["11"]["ceiling"] + 1e-9 and sum(at["11"]["keys"]) >= 1
        assert 0 <= m[name]["zero_blocks"] <= 1 and res["history"][name]["entropy"]
    # the controls carry REM's sparsity; SNIP its final one
    for name in ("MP", ch06.WEIGHT_DECAY, "SNIP"):
        assert m[name]["sparsity"] == pytest.approx(path[-1], abs=0.01), name
    assert m["REM (LOBSTER)"]["gate_active_mean"]["applied"] > m["REM (LOBSTER)"]["gate_active_mean"]["raw"]
    groups = ch06.unit_groups(smoke=True)
    frame = ch06.unit_frame(groups)
    assert frame.loc["vanilla (+Q)", "accuracy (+Q)"] == "not yet run" and frame.loc["SNIP", "seeds"] == 1
    assert frame.loc["REM (LOBSTER)", "entropy H (bits)"] == f"{m['REM (LOBSTER)']['by_K']['11']['entropy']:.2f}"
    assert "the unpruned DR-CapsNet (0 of 5" in U.banner(groups)
    figs = [ch06.draw_levels(groups), ch06.draw_entropy_accuracy(groups)]
    assert all(f.axes for f in figs)
    plt.close("all")
    assert ch06.k_rule([2, 5, 7, 11], [0.2, 0.9, 0.995, 0.996], 0.002) == 7
    # the paper-scale column of the comparison table reads the same result (REM's rows; no vanilla result yet)
    rem = m["REM (LOBSTER)"]
    for key, value, fmt, unit in (("rem_acc_rem", rem["by_K"]["11"]["accuracy"], ".2%", ""),
                                  ("rem_entropy_rem", rem["by_K"]["11"]["entropy"], ".2f", " bits"),
                                  ("rem_sparsity", rem["sparsity"], ".2%", "")):
        assert U.paper_scale_cell(key, smoke=True) == f"{format(value, fmt)}{unit} (1 of 5 seeds)", key
    assert U.paper_scale_cell("rem_acc_vanilla", smoke=True) == "not yet run"


def test_chapter6_paper_scale_sentence_reads_the_vanilla_results():
    def result(seed, flt, accs):
        by_k = {str(k): {"accuracy": a, "entropy": 6.0 + seed, "ceiling": 10.0, "share_uniform_level": 0.9}
                for k, a in accs.items()}
        return {"seed": seed, "metrics": {"vanilla": {"float_accuracy": flt, "by_K": by_k}}}
    runs = [result(0, 0.990, {2: 0.90, 5: 0.989, 7: 0.991, 11: 0.990}),
            result(1, 0.992, {2: 0.95, 5: 0.990, 7: 0.992, 11: 0.993})]
    groups = [U.Group("06/vanilla", "v", runs, [], []), U.Group("06/pruned", "p", [], [], [])]
    said = ch06.paper_scale_summary(groups, 11)
    # K = 5 loses accuracy on the mean (0.9895 < 0.991); K = 7 does not (0.9915)
    assert "picks K = 7" in said and "99.10% test accuracy" in said and "99.15% with couplings" in said
    assert "6.50 bits, 65% of the ceiling of 10.00 bits" in said and "mean of 2 seeds" in said
    empty = [U.Group("06/vanilla", "v", [], ["06/vanilla/s0"], []), groups[1]]
    assert "no paper-scale run" in ch06.paper_scale_summary(empty, 11)
