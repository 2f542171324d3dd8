"""Experiment units (capslib.book.units), their runner (capslib.tools.experiments) and the paper's
shift augmentation (capslib.data.random_shift), at smoke sizes on the CPU."""
import json
import os

import numpy as np
import pytest
import torch

from capslib import data, multimnist, train
from capslib.book import paper
from capslib.book import ch02
from capslib.book import units as U
from capslib.tools import experiments as X


# ----------------------------------------------------------------------------- the shift augmentation

def test_random_shift_moves_each_image_within_range_with_zero_fill():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(40, 2, 9, 7, generator=g) + 0.1      # no zeros inside: the fill is visible
    out = data.random_shift(x, 2, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    seen = set()
    for b in range(len(x)):
        matches = []
        for dy in range(-2, 3):
            for dx in range(-2, 3):
                ref = torch.zeros_like(x[b])
                src = x[b][:, max(0, -dy):9 - max(0, dy), max(0, -dx):7 - max(0, dx)]
                ref[:, max(0, dy):max(0, dy) + src.shape[1], max(0, dx):max(0, dx) + src.shape[2]] = src
                if torch.equal(ref, out[b]):
                    matches.append((dy, dx))
        assert len(matches) == 1, f"image {b}: matches {matches}"
        seen.add(matches[0])
    assert len(seen) > 10          # the offsets vary from image to image


def test_random_shift_seeded_identity_at_zero_and_errors():
    x = torch.rand(8, 1, 28, 28)
    a = data.RandomShift(2, seed=5)(x)
    b = data.RandomShift(2, seed=5)(x)
    c = data.RandomShift(2, seed=6)(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(data.random_shift(x, 0), x)
    with pytest.raises(ValueError, match="max_shift"):
        data.random_shift(x, -1)
    with pytest.raises(ValueError, match="off itself"):
        data.random_shift(x, 28)
    with pytest.raises(ValueError, match="floating"):
        data.random_shift(torch.zeros(2, 28, 28), 2)
    with pytest.raises(ValueError, match="max_shift"):
        data.RandomShift(1.5)


def test_fit_applies_augment_and_fingerprints_it():
    x, y = torch.rand(16, 1, 28, 28), torch.randint(0, 10, (16,))
    seen = []

    def step(model, xb, yb):
        seen.append(xb.clone())
        s = model(xb.flatten(1))
        return torch.nn.functional.cross_entropy(s, yb), s

    net = torch.nn.Linear(784, 10)
    train.fit(net, data.Split(x, y), step, epochs=1, batch_size=16, seed=0, progress=False,
              augment=lambda xb: torch.zeros_like(xb))
    assert torch.equal(seen[0], torch.zeros_like(seen[0]))
    opt = torch.optim.Adam(net.parameters())
    f = lambda aug: train.run_fingerprint(net, data.Split(x, y), opt, loss_fn=step, batch_size=16,  # noqa: E731
                                          lr_decay=None, seed=0, amp=False, augment=aug)
    assert f(data.RandomShift(2, 0)) != f(data.RandomShift(1, 0)) != f(None)
    assert f(data.RandomShift(2, 0)) == f(data.RandomShift(2, 0))


# ----------------------------------------------------------------------------- the plan

def test_finishes_and_plan_follow_the_sharing_model():
    s1, s2 = U.SHARE[1], U.SHARE[2]
    assert X.finishes([100.0], 100.0) and not X.finishes([100.0], 99.0)
    # two equal units side by side end together at 100 / SHARE[2]
    assert X.finishes([100.0, 100.0], 100 / s2) and not X.finishes([100.0, 100.0], 100 / s2 - 1)
    p = X.plan([("a", 100.0), ("b", 100.0), ("c", 50.0)], jobs=1, budget=260.0)
    assert [(q.key, q.start, q.end) for q in p] == [("a", 0, 100 / s1), ("b", 100, 200), ("c", 200, 250)]
    # a unit that cannot end in the budget is skipped, the next one taken
    p = X.plan([("long", 500.0), ("short", 60.0)], jobs=1, budget=100.0)
    assert [q.key for q in p] == ["short"]
    # with two slots the second unit starts only if both still end inside the budget
    p = X.plan([("a", 100.0), ("b", 100.0)], jobs=2, budget=100 / s2 + 1)
    assert [q.start for q in p] == [0, 0]
    p = X.plan([("a", 100.0), ("b", 100.0)], jobs=2, budget=150.0)
    assert [(q.key, q.start) for q in p] == [("a", 0)]
    with pytest.raises(ValueError, match="jobs"):
        X.plan([], jobs=0, budget=10)
    with pytest.raises(ValueError, match="budget"):
        X.plan([], jobs=1, budget=0)


def test_sharing_measured_on_the_h100_is_below_one_and_total_grows():
    assert U.SHARE[1] == 1.0
    totals = [k * U.SHARE[k] for k in (1, 2, 3, 4)]
    assert all(0 < U.SHARE[k] < 1 for k in (2, 3, 4)) and totals == sorted(totals)


def test_every_unit_is_projected_within_eight_minutes_alone_on_an_h100():
    units = U.all_units()
    assert {u.key for u in units} >= {"02/main/s0", "02/main/s1", "02/main/s2", "02/baseline/s0",
                                      "02/table1/r1-norecon/s0", "02/table1/r3-norecon/s2"}
    for u in units:
        assert U.projected_seconds(u) <= 8 * 60, u.key


# ----------------------------------------------------------------------------- results

def test_encoded_arrays_round_trip():
    for a, dt in [(np.arange(12).reshape(3, 4), "int64"), (np.random.rand(2, 3), "float32"),
                  (np.arange(256).astype(np.uint8), "uint8")]:
        back = U.decode_array(json.loads(json.dumps(U.encode_array(a, dt))))
        assert back.dtype == np.dtype(dt) and np.array_equal(back, a.astype(dt))
    with pytest.raises(ValueError, match="b64"):
        U.decode_array({"dtype": "uint8"})


def _toy_unit(config, probe_value):
    def run(unit, device, smoke):
        return {"metrics": {"x": unit.config["x"], "smoke": smoke}, "history": {"loss": [1.0, 0.5]},
                "arrays": {"a": U.encode_array(np.ones(3))}}
    return U.Unit("99", "toy", 0, run, config, lambda u: {"v": probe_value}, "capsnet28", 1000, 1, "a toy")


def test_unit_write_load_and_stale_detection(tmp_path, monkeypatch):
    monkeypatch.setattr(U, "RESULTS_ROOT", tmp_path)
    unit = _toy_unit({"x": 1}, 0.5)
    assert U.state(unit)[0] == "missing"
    path = U.execute(unit, device="cpu")
    assert path == tmp_path / "full" / "99" / "toy" / "s0.json"
    st, res = U.state(unit)
    assert st == "done" and res["metrics"] == {"x": 1, "smoke": False} and res["device"].startswith("cpu")
    assert {"fingerprint", "config", "probe", "torch", "commit", "wall_seconds", "history"} <= set(res)
    # another configuration or another computation makes the stored result stale
    assert U.state(_toy_unit({"x": 2}, 0.5))[0] == "stale"
    assert U.state(_toy_unit({"x": 1}, 0.25))[0] == "stale"
    # the probe is compared within PROBE_RTOL: rounding noise changes nothing, a changed computation does
    assert U.state(_toy_unit({"x": 1}, 0.5 * (1 + 1e-9)))[0] == "done"
    assert U.state(_toy_unit({"x": 1}, 0.5 * (1 + 1e-4)))[0] == "stale"
    # a smoke run writes elsewhere
    assert U.execute(unit, device="cpu", smoke=True) == tmp_path / "full-smoke" / "99" / "toy" / "s0.json"


def test_registry_rejects_bad_units_and_names_known_ones():
    with pytest.raises(KeyError, match="02/main/s0"):
        U.get("02/main/s9")
    with pytest.raises(ValueError, match="twice"):
        U.register(U.get("02/main/s0"))
    with pytest.raises(ValueError, match="two digits"):
        U.register(U.Unit("2", "x", 0, lambda *a: {}))
    with pytest.raises(KeyError, match="no unit matches"):
        U.select(["02/nothing"])
    assert [u.key for u in U.select(["02/main"])] == ["02/main/s0", "02/main/s1", "02/main/s2"]


def test_baseline_cnn_has_the_papers_parameter_count():
    n = sum(p.numel() for p in ch02.BaselineCNN().parameters())
    assert round(n / 1e6, 1) == paper.value("sabour_baseline_params")
    # chapter 2's ablation at ci: convolutions scaled like its CapsNet's, the fully connected layers the paper's
    small = ch02.BaselineCNN.scaled(16 / 256)
    convs = [m.out_channels for m in small.features if isinstance(m, torch.nn.Conv2d)]
    linears = [m.out_features for m in small.head if isinstance(m, torch.nn.Linear)]
    assert convs == [16, 16, 8] and linears == [328, 192, 10]
    assert [m.out_channels for m in ch02.BaselineCNN.scaled(1e-3).features if isinstance(m, torch.nn.Conv2d)] == [1, 1, 1]
    with pytest.raises(ValueError, match="conv_scale"):
        ch02.BaselineCNN.scaled(0)


@pytest.fixture(scope="module")
def main_smoke(tmp_path_factory):
    """The chapter-2 main unit's smoke run, made once for the tests below: its results folder."""
    root = tmp_path_factory.mktemp("units")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(U, "RESULTS_ROOT", root)
        U.execute(U.get("02/main/s0"), device="cpu", smoke=True)
    return root


def test_chapter2_main_unit_smoke_writes_what_the_figures_need(main_smoke, monkeypatch):
    monkeypatch.setattr(U, "RESULTS_ROOT", main_smoke)
    unit = U.get("02/main/s0")
    res = U.load(unit, smoke=True)
    m, a = res["metrics"], res["arrays"]
    assert res["smoke"] and res["processes"] == 1
    assert 0 <= m["test_accuracy"] <= 1 and m["test_errors"] == round((1 - m["test_accuracy"]) * m["test_images"])
    assert len(res["history"]["val_acc"]) == ch02.SMOKE["epochs"]
    grid = U.decode_array(a["perturb_grid"])
    steps = U.decode_array(a["perturb_offsets"])
    assert grid.shape == (16, len(steps), 28, 28) and steps[0] == pytest.approx(-paper.value("sabour_perturb_range"))
    assert steps[len(steps) // 2] == 0 and steps[1] - steps[0] == pytest.approx(paper.value("sabour_perturb_step"))
    mid = grid[:, len(steps) // 2]            # no change in any dimension: every row's middle image is the same
    assert (mid == mid[0]).all()
    assert U.decode_array(a["recon_input"]).shape == U.decode_array(a["recon_output"]).shape == (20, 28, 28)
    hist = U.decode_array(a["coupling_hist"])
    assert hist.sum() == m["coupling"]["digits"] * unit_input_capsules() * 10


def unit_input_capsules():
    net = ch02.build(U.get("02/main/s0"), smoke=True)
    return net.digit.in_caps


def test_runner_dry_run_and_cli_errors(capsys, tmp_path, monkeypatch):
    assert X.main(["run", "--budget", "540", "--jobs", "4", "--only", "02/main", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "the plan runs" in out and "02/main/s" in out   # whichever seeds have no result yet
    assert X.main(["status", "--chapter", "02"]) == 0
    assert "02/baseline/s2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        X.main(["run", "--budget", "-1"])
    with pytest.raises(KeyError, match="chapters with units"):
        X.main(["status", "--chapter", "09"])
    # a real run checks for its data first (a GPU machine cannot download it): one clear message
    todo = next(u.key for u in U.all_units() if u.config.get("dataset") == "mnist" and U.state(u)[0] != "done")
    monkeypatch.setattr(data, "DATA_DIR", tmp_path)
    with pytest.raises(SystemExit, match="full MNIST is not in"):
        X.main(["run", "--budget", "60", "--only", todo])


def test_idx_files_are_read_plain_or_gzip_compressed(tmp_path):
    import gzip

    images = (np.arange(2 * 5 * 4) % 256).astype(np.uint8).reshape(2, 5, 4)
    data._write_idx_images(tmp_path / "img", images)
    (tmp_path / "img.gz").write_bytes(gzip.compress((tmp_path / "img").read_bytes()))
    assert np.array_equal(data._read_idx(tmp_path / "img"), images)
    (tmp_path / "img").unlink()
    assert np.array_equal(data._read_idx(tmp_path / "img"), images)


def test_chapter2_paper_scale_views_from_results(main_smoke, monkeypatch):
    """Write -> load -> figure: the smoke result of the main unit feeds Table 1's frame and the three
    figures; the missing runs are named in the banner."""
    import matplotlib
    matplotlib.use("Agg")
    monkeypatch.setattr(U, "RESULTS_ROOT", main_smoke)
    groups = ch02.table1_groups(smoke=True)
    main = groups[-1]
    assert len(main.results) == 1 and main.missing == ["02/main/s1", "02/main/s2"]
    frame = ch02.table1_frame(groups)
    assert frame.loc["3 iterations, reconstruction", "seeds"] == 1
    assert frame.loc["baseline CNN", "this book: test error (%)"] == "not yet run"
    text = U.banner(groups)
    assert "still to be made" in text and "1 of 3 seeds run so far" in text and "02/" not in text
    for fig in (ch02.draw_reconstructions(main.results[0]), ch02.draw_perturbations(main.results[0]),
                ch02.draw_couplings(main.results)):
        assert fig.axes
    assert U.banner([U.Group("x", "x", [{}], [], [])]) is None
    # the sentence under the table: the result's own error and coupling entropy, a seed count, the paper's number
    r = main.results[0]
    said = ch02.paper_scale_summary(main.results)
    assert f"{r['metrics']['test_error']:.2%}" in said and "one seed" in said and paper.text("sabour_mnist_error") in said
    assert f"{r['metrics']['coupling']['mean_entropy_bits']:.4f} bits" in said
    assert "no paper-scale run" in ch02.paper_scale_summary([])


def test_probe_agrees_across_cpu_kernels():
    """The probe of chapter 2's units computed with the CPU's widest vector kernels and with the
    plain ones (``ATEN_CPU_CAPABILITY=default``) agrees within PROBE_RTOL: a result made on one
    machine reads current on another."""
    import subprocess
    import sys

    # one CapsNet unit (the baseline CNN's probe, a 35M-parameter float64 step, took most of this test's
    # time; its operations, convolutions and matrix products, are those the CapsNet's probe runs too)
    keys = ["02/main/s0"]
    code = ("import json; from capslib.book import units as U\n"
            f"print(json.dumps({{k: U.probe_values(U.get(k)) for k in {keys!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": "default"})
    assert out.returncode == 0, out.stderr[-1500:]
    other = json.loads(out.stdout.strip().splitlines()[-1])
    for k in keys:
        here = U.probe_values(U.get(k))
        assert U.probe_agrees(other[k], here), k
        assert not U.probe_agrees({n: v * (1 + 1e-4) for n, v in other[k].items()}, here)


def test_a_paper_scale_result_is_not_made_under_the_smoke_switch(tmp_path, monkeypatch):
    monkeypatch.setattr(U, "RESULTS_ROOT", tmp_path)
    monkeypatch.setenv("CAPSBOOK_SMOKE", "1")
    with pytest.raises(RuntimeError, match="CAPSBOOK_SMOKE"):
        U.execute(_toy_unit({"x": 1}, 0.5), device="cpu")


def test_runner_counts_a_unit_past_its_projection():
    assert not X.finishes([-20.0, 200.0], 201.0)      # the overrunning unit still shares the GPU
    assert X.finishes([-20.0, 200.0], 200 / U.SHARE[2] + X.MIN_LEFT_SECONDS)


def test_bundle_carries_notebooks_without_outputs(tmp_path):
    """The offline bundle's source archive: every tracked file, notebooks stripped of their outputs
    (the node executes them again; the committed figures were most of the bundle's size)."""
    import tarfile

    from capslib.tools import bundle

    dest = tmp_path / "src.tar.gz"
    bundle.write_source(dest)
    with tarfile.open(dest) as tar:
        names = tar.getnames()
        nb = json.load(tar.extractfile("book/02_dynamic_routing.ipynb"))
    assert "capslib/book/units.py" in names and "capslib/tools/experiments.py" in names
    assert not any(n.startswith("book/_static/frames/") for n in names)       # outputs, like the notebooks'
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert any("ch02_units" in "".join(c["source"]) for c in code)
    assert dest.stat().st_size < 5 * 2 ** 20


def test_runner_stops_a_unit_at_the_budget_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """The live loop: a smoke unit given an 8-s budget is started, stopped at the budget with its whole
    process group, leaves no result, and the run's exit code says so. The smoke unit alone takes 7 to 15 s
    on the CPUs seen, so the child is held 60 s before it starts (a sitecustomize on its path): the budget,
    not the machine's speed, decides."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(slow), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("CAPSBOOK_UNITS_RESULTS", str(tmp_path))
    monkeypatch.setattr(U, "RESULTS_ROOT", tmp_path)
    monkeypatch.setattr(X, "LOG_DIR", tmp_path / "logs")
    assert X.main(["run", "--budget", "8", "--smoke", "--only", "02/main/s0"]) == 1
    out = capsys.readouterr().out
    assert "started 02/main/s0" in out and "budget reached: stopped 02/main/s0" in out
    assert not (tmp_path / "full-smoke" / "02" / "main" / "s0.json").exists()
    assert (tmp_path / "logs" / "02_main_s0.log").exists()


def test_projection_sources_are_named_measured_bench_or_assumed():
    # fit on an H100 measured the 28x28 CapsNet; the EM network only in the step bench; an unknown
    # network falls back to the slowest benched CapsNet, so its projection errs long
    rate, source = U.rate_of("capsnet28")
    assert source == "measured" and rate == U.RATES_H100["capsnet28"]
    rate, source = U.rate_of("em32")
    assert source == "bench" and 0 < rate < U.RATES_H100["capsnet28"]
    rate, source = U.rate_of("no-such-network")
    assert source == "assumed" and rate == U.UNBENCHED_RATE
    assert U.UNBENCHED_RATE <= min(v for k, v in U.ESTIMATED_RATES_H100.items() if k.startswith("capsnet"))


def test_graphed_units_are_planned_without_a_gain_from_sharing():
    """On one H100 four graphed units side by side each ran at about a quarter of their speed alone;
    the plan gives a unit on the fast path 1/k of its speed, eager units the measured SHARE."""
    assert U.share_of(4, True) == 0.25 and U.share_of(4, False) == U.SHARE[4] > 0.25
    main = U.get("02/main/s0")
    assert U.graphed(main) and U.projected_seconds(main, 4) > U.projected_seconds(main, 1)
    # two graphed units of 100 s each side by side end at 200 s, not at 100 / SHARE[2]
    assert X.finishes([100.0, 100.0], 200.0, graphed=True) and not X.finishes([100.0, 100.0], 199.0, graphed=True)
    assert X.finishes([100.0, 100.0], 100 / U.SHARE[2], graphed=False)
    p = X.plan([("a", 100.0), ("b", 100.0)], jobs=2, budget=150.0, graphed=frozenset({"a"}))
    assert [(q.key, q.start, q.end) for q in p] == [("a", 0, 100)]   # b would end at 200 beside a, or after it
    p = X.plan([("a", 100.0), ("b", 100.0)], jobs=2, budget=200.0, graphed=frozenset({"a"}))
    assert [(q.key, q.start, q.end) for q in p] == [("a", 0, 200), ("b", 0, 200)]
    # the fast path's rate comes from the fast check on an H100, when there is one
    if "capsnet28" in U.FAST_RATES_H100:
        rate, source = U.rate_of("capsnet28", True)
        assert source == "measured" and rate > U.RATES_H100["capsnet28"]


def test_overlap_counts_who_shared_the_gpu_and_the_result_records_it(tmp_path, monkeypatch):
    spans = {"a": (0.0, 100.0), "b": (0.0, 40.0), "c": (50.0, 120.0), "d": (130.0, 140.0)}
    assert X.overlap(spans, "a") == (2, ["b", "c"])      # never three at once: b ended before c began
    assert X.overlap(spans, "c") == (2, ["a"])
    assert X.overlap(spans, "d") == (1, [])
    monkeypatch.setattr(U, "RESULTS_ROOT", tmp_path)
    unit = _toy_unit({"x": 1}, 0.5)
    with pytest.raises(FileNotFoundError, match="99/toy/s0"):
        U.record_sharing(unit, 2, ["b"])
    U.execute(unit, device="cpu")
    U.record_sharing(unit, 3, ["b", "c"])
    st, res = U.state(unit)
    assert st == "done" and res["sharing_gpu"] == 3 and res["shared_with"] == ["b", "c"] and res["ran_alone"] is False


# ----------------------------------------------------------------------------- MultiMNIST at paper scale

def test_multimnist_units_are_declared_and_projected_within_eight_minutes():
    units = [u for u in U.all_units("02") if u.key.startswith("02/multimnist/")]
    assert [u.key for u in units] == [f"02/multimnist/s{s}" for s in ch02.SEEDS]
    for u in units:
        assert u.images == ch02.MULTIMNIST["epochs"] * ch02.MULTIMNIST["pairs"]
        assert u.family == ch02.MULTIMNIST_FAMILY and U.projected_seconds(u) <= 8 * 60
        assert u.config["canvas"] == multimnist.SIZE and u.config["shift"] == multimnist.SHIFT   # the paper's
    # after every Table 1 unit of the same seed
    t1 = max(u.priority for u in U.all_units("02") if u.seed == 0 and not u.key.startswith("02/multimnist"))
    assert units[0].priority > t1


def test_multimnist_unit_smoke_writes_what_its_figure_needs(tmp_path, monkeypatch):
    monkeypatch.setattr(U, "RESULTS_ROOT", tmp_path)
    unit = U.get("02/multimnist/s0")
    U.execute(unit, device="cpu", smoke=True)
    res = U.load(unit, smoke=True)
    m, a = res["metrics"], res["arrays"]
    assert m["train_pairs"] == ch02.MULTIMNIST_SMOKE["pairs"] and m["test_pairs"] == ch02.MULTIMNIST_SMOKE["test_pairs"]
    assert 0 <= m["test_accuracy"] <= 1 and m["test_error"] == pytest.approx(1 - m["test_accuracy"])
    assert 0 <= m["segmentation"] <= 1 and m["reconstruction_error"] > 0
    k = ch02.MULTIMNIST["shown_pairs"]
    S = multimnist.SIZE
    assert U.decode_array(a["shown_input"]).shape == (k, S, S)
    assert U.decode_array(a["shown_digits"]).shape == U.decode_array(a["shown_reconstructions"]).shape == (k, 2, S, S)
    # the input is the pixelwise maximum of the two digits it shows
    x, d = U.decode_array(a["shown_input"]), U.decode_array(a["shown_digits"])
    assert np.array_equal(x, d.max(axis=1))
    summary = ch02.multimnist_summary([res])
    assert "test pairs" in summary and "sum of squared pixels" in summary
    assert ch02.multimnist_summary([]).startswith("no ")
    assert U.paper_scale_cell("sabour_multimnist_error", smoke=True) == f"{m['test_error']:.1%} (1 of 3 seeds)"
    import matplotlib.pyplot as plt
    fig = ch02.draw_multimnist(res)
    assert len(fig.axes) == 4 * k      # input, the two digits, each digit's reconstruction in a row of its own
    plt.close(fig)


def test_comparison_tables_gain_a_paper_scale_column_from_the_committed_units(main_smoke, monkeypatch):
    """results.paper_vs_book: a column read from the units that measure a row's paper number (mean ± SD over the
    seeds run, or "not yet run"), "—" in rows no unit measures, and no column when no row has a counterpart."""
    from capslib.book import results

    col = "this book at paper scale (± SD over seeds)"
    rows = [("MNIST test error", "sabour_mnist_error", "1.00%"), ("learning rate", "gu_lr", "0.001")]
    monkeypatch.setattr(U, "RESULTS_ROOT", main_smoke.parent / "empty")
    frame = results.paper_vs_book(rows)
    assert list(frame.columns) == ["paper", "this book", col, "note"]
    assert list(frame[col]) == ["not yet run", "—"]
    assert col not in results.paper_vs_book(rows[1:]).columns
    # with the main unit's smoke result: its test error, one of the three seeds declared
    monkeypatch.setattr(U, "RESULTS_ROOT", main_smoke)
    err = U.load(U.get("02/main/s0"), smoke=True)["metrics"]["test_error"]
    assert U.paper_scale_cell("sabour_mnist_error", smoke=True) == f"{err:.2%} (1 of 3 seeds)"
    assert U.paper_scale_cell("gu_lr") is None and U.paper_scale_cell(None) is None
    with pytest.raises(ValueError, match="not a key"):
        U.paper_scale("no_such_number", "02/main", lambda m: m["test_error"], ".2%")
    with pytest.raises(ValueError, match="twice"):
        U.paper_scale("sabour_mnist_error", "02/main", lambda m: m["test_error"], ".2%")
    with pytest.raises(ValueError, match="quantity"):
        U.paper_scale("", "02/main", lambda m: m["test_error"], ".2%", row=True)
    with pytest.raises(ValueError, match="baseline"):
        U.paper_scale("a paired row", "02/main", lambda m: m["test_error"], ".2%", row=True, baseline="02/main")
    assert "a paired row" not in U.PAPER_SCALE
    # every declared counterpart names units that exist, on both sides of a paired cell
    for key, ps in U.PAPER_SCALE.items():
        for prefix in (ps.prefix,) + ((ps.baseline,) if ps.baseline is not None else ()):
            assert U.select([prefix]), (key, prefix)


def test_a_paper_scale_cell_says_which_of_a_rows_numbers_it_gives(main_smoke, monkeypatch):
    monkeypatch.setattr(U, "RESULTS_ROOT", main_smoke)
    monkeypatch.setitem(U.PAPER_SCALE, "a row of two numbers", U.PaperScale("02/main", lambda m: m["test_error"], ".2%",
                                                                              "test error"))
    err = U.load(U.get("02/main/s0"), smoke=True)["metrics"]["test_error"]
    assert U.paper_scale_cell(None, smoke=True, quantity="a row of two numbers") == f"test error {err:.2%} (1 of 3 seeds)"
    # chapters 3, 4 and 7 declare rows too, now that their comparison tables have units behind them
    U._load_chapters()
    prefixes = {ps.prefix.split("/")[0] for ps in U.PAPER_SCALE.values()}
    assert {"02", "03", "04", "05", "06", "07"} <= prefixes


def test_a_paper_scale_cell_carries_the_papers_unit_unless_it_is_a_percentage(main_smoke, monkeypatch):
    monkeypatch.setattr(U, "RESULTS_ROOT", main_smoke)
    bits = next(k for k, e in paper.table().items() if e.get("unit") == "bits")
    monkeypatch.setitem(U.PAPER_SCALE, bits, U.PaperScale("02/main", lambda m: m["test_error"], ".3f"))
    err = U.load(U.get("02/main/s0"), smoke=True)["metrics"]["test_error"]
    assert U.paper_scale_cell(bits, smoke=True) == f"{err:.3f} bits (1 of 3 seeds)"
    assert U.paper_scale_cell("sabour_mnist_error", smoke=True) == f"{err:.2%} (1 of 3 seeds)"   # "%" is in the number


def test_every_row_declared_for_the_paper_scale_column_is_a_row_of_a_committed_comparison_table():
    """A row keyed by its quantity (no paper number) must match a row the chapters' tables print, or its
    paper-scale cell would silently go missing when a label changes."""
    import json
    from pathlib import Path

    from capslib.book import paper

    U._load_chapters()
    shown = ""
    for nb in sorted(Path(__file__).resolve().parents[1].glob("book/0*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code" and "paper_vs_book(" in "".join(cell["source"]):
                shown += "".join("".join(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", []))
    rows = [k for k in U.PAPER_SCALE if not paper.is_key(k)]
    assert rows, "chapter 5 declares rows without a paper number"
    for quantity in rows:
        assert f"\n{quantity} " in shown, f"{quantity!r} is no row of a committed comparison table"


def test_seed_spread_signs_the_mean_of_a_difference_not_its_spread():
    from capslib.book.units import seed_spread
    assert seed_spread([0.001, 0.002, -0.001], "+.4f") == "+0.0007 ± 0.0015"
    assert seed_spread([0.00001], "+.3f") == "0.000" and seed_spread([], "+.3f") == "not yet run"
    assert seed_spread([0.1, 0.2], ".2f") == "0.15 ± 0.07"


def test_a_paired_paper_scale_cell_subtracts_the_baseline_seed_by_seed():
    """Chapter 3's row "M routes minus a single route" at paper scale: each seed's M-route accuracy minus the
    single route's of the same seed, from the committed results, not the difference of two means of other seeds."""
    import json

    from capslib.book import ch03

    row = "test accuracy of M routes minus a single route's"
    ps = U.PAPER_SCALE[row]
    assert ps.baseline == "03/routes/M1" and ps.prefix == f"03/routes/M{ch03.UNIT_MAIN_ROUTES}"
    acc = {}
    for prefix in (ps.prefix, ps.baseline):
        for f in sorted((U.RESULTS_ROOT / "full" / prefix).glob("s*.json")):
            r = json.loads(f.read_text())
            acc[prefix, r["seed"]] = r["metrics"]["test_accuracy"]
    seeds = sorted(s for p, s in acc if p == ps.prefix and (ps.baseline, s) in acc)
    assert len(seeds) >= 2, "the committed results hold no pair to compare"
    d = [acc[ps.prefix, s] - acc[ps.baseline, s] for s in seeds]
    cell = U.paper_scale_cell(None, quantity=row)
    assert cell.startswith(f"M = {ch03.UNIT_MAIN_ROUTES}, paired: {U.seed_spread(d, '+.4f')} (")
