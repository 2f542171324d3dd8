"""The sourced paper table (capslib.book.paper), comparisons over seeds (capslib.book.stats) and the glue helpers."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from capslib.book import paper, results, stats


# --- the paper table -------------------------------------------------------------------------
def test_paper_table_is_valid_and_sourced():
    t = paper.table()
    assert len(t) >= 20
    bib = paper._bib_keys()
    for key, e in t.items():
        assert e["paper"] in bib, key
        assert e["where"].strip(), key


def test_paper_text_keeps_printed_precision():
    assert paper.text("sabour_mnist_error") == "0.25%"
    assert paper.text("rem_acc_vanilla") == "99.57%"
    assert paper.text("rem_entropy_q", pm=True) == "9.53 ± 0.54 bits"
    assert paper.text("hauser_train_minutes") == "15 min"
    assert paper.value("rem_sparsity") == pytest.approx(85.53)
    assert paper.source("rem_sparsity") == "Renzulli et al. 2025, Table 9"
    assert paper.cite("gu2020improving") == "Gu and Tresp (2020)" and paper.cite("hauser2019poe") == "Hauser (2019)"
    assert paper.cite("lecun1998mnist", parenthetical=True) == "LeCun et al. 1998"
    with pytest.raises(ValueError, match="not an entry of references.bib"):
        paper.cite("nobody1999")


def test_paper_unknown_key_is_a_clear_error():
    with pytest.raises(KeyError, match="not in paper_results.yml"):
        paper.entry("sabour_nonexistent")


@pytest.mark.parametrize("change, message", [
    ({"value": "99"}, "value must be a number"),
    ({"paper": "nobody2020"}, "not a key of references.bib"),
    ({"unit": "furlongs"}, "unit"),
    ({"chapter": 6}, "chapter must be two digits"),
    ({"book": {"metric": "x", "as": "log"}}, "book must be"),
    ({"colour": "red"}, "unknown"),
    ({"book": {"metric": "x", "as": "value", "seeds": "a/*", "se": "b"}}, "one of seeds, se and seed_list"),
    ({"book": {"metric": "x", "as": "value", "proxy": True}}, "proxy must be true and come with a note"),
])
def test_paper_validation_names_the_entry_and_field(change, message):
    good = dict(paper.entry("rem_sparsity"))
    with pytest.raises(ValueError, match=message):
        paper.validate({"rem_sparsity": dict(good, **change)}, paper._bib_keys())


def test_paper_scoreboard_mappings_read_known_metrics():
    for key, e in paper.table().items():
        if "book" in e:
            assert e["book"]["metric"].isidentifier(), key


def test_book_reading_spread_over_seeds_binomial_or_none(monkeypatch):
    """The scoreboard's cell: the mean over the seeds found by the path (checked against the recorded
    metric), a binomial interval for one run, a plain value otherwise."""
    entries = {
        "s": {"book": {"metric": "acc", "as": "percent", "seeds": "per_seed/*/net/acc"}},
        "b": {"book": {"metric": "acc", "as": "error_percent", "se": "acc_se"}},
        "n": {"book": {"metric": "acc", "as": "percent", "seed_list": "seeds"}},
        "o": {"book": {"metric": "acc", "as": "value"}},
    }
    monkeypatch.setattr(paper, "entry", lambda key: entries[key])
    per_seed = {"0": {"net": {"acc": 0.90}}, "1": {"net": {"acc": 0.94}}, "2": {"net": {"acc": 0.92}}}
    r = paper.book_reading("s", {"acc": 0.92, "per_seed": per_seed})
    assert r["n"] == 3 and r["value"] == pytest.approx(92.0)
    assert r["half"] == pytest.approx(100 * stats.summarise([0.90, 0.94, 0.92]).half)
    with pytest.raises(ValueError, match="is not the recorded acc"):
        paper.book_reading("s", {"acc": 0.95, "per_seed": per_seed})
    with pytest.raises(KeyError, match="no 'net'"):
        paper.book_reading("s", {"acc": 0.92, "per_seed": {"0": {"other": {}}}})
    r = paper.book_reading("b", {"acc": 0.99, "acc_se": 0.001})
    assert r["value"] == pytest.approx(1.0) and r["half"] == pytest.approx(0.196) and r["n"] == 1
    assert paper.book_reading("n", {"acc": 0.5, "seeds": [0, 1]})["n"] == 2
    assert paper.book_reading("o", {"acc": 0.5}) == {"value": 0.5, "half": None, "n": 1, "how": "one run"}
    assert paper.book_reading("o", {"acc": None}) is None and paper.book_reading("o", {}) is None


def test_paper_vs_book_takes_keys_and_refuses_typed_paper_numbers():
    df = results.paper_vs_book([
        ("MNIST error", "sabour_mnist_error", "3.6%", "ci"),
        ("couplings", "polarized (near zero or one)", "entropy 1.2"),
        ("ImageNet", None, "not run"),
    ])
    assert df.loc["MNIST error", "paper"].startswith("0.25 ± 0.005%")
    assert "(Sabour et al. 2017, Table 1)" in df.loc["MNIST error", "paper"]
    assert df.loc["ImageNet", "paper"] == "not reported"
    with pytest.raises(ValueError, match="paper_results.yml"):
        results.paper_vs_book([("MNIST error", "0.25%", "3.6%")])
    with pytest.raises(ValueError, match="paper_results.yml"):
        results.paper_vs_book([("MNIST error", 0.25, "3.6%")])
    labelled = results.paper_vs_book([("MNIST error", "sabour_mnist_error", "3.6% ± 0.4%")],
                                     paper_pm="SD over 3 trials", book_pm="95 % interval over 3 seeds")
    assert list(labelled.columns) == ["paper (± SD over 3 trials)", "this book (± 95 % interval over 3 seeds)",
                                      "this book at paper scale (± SD over seeds)", "note"]   # the units of 02/main
    with pytest.raises(ValueError, match="what the ± is"):
        results.paper_vs_book([("MNIST error", "sabour_mnist_error", "3.6%")], book_pm=" ")


# --- statistics over seeds ---------------------------------------------------------------------
def test_summary_matches_scipy_t_interval():
    from scipy import stats as sps

    vals = [0.91, 0.93, 0.96, 0.90]
    s = stats.summarise(vals, seeds=[0, 1, 2, 3])
    lo, hi = sps.t.interval(0.95, len(vals) - 1, loc=np.mean(vals), scale=sps.sem(vals))
    assert s.mean == pytest.approx(np.mean(vals))
    assert s.sd == pytest.approx(np.std(vals, ddof=1))
    assert (s.lo, s.hi) == (pytest.approx(lo), pytest.approx(hi))
    assert f"{s:.3f}" == f"{s.mean:.3f} ± {s.half:.3f} (n = 4, 95% t)"


def test_single_run_has_no_interval():
    s = stats.summarise([0.5])
    assert s.half == 0 and s.sd == 0 and s.n == 1


def test_over_seeds_runs_each_seed_and_keeps_keys():
    seen = []

    def run(seed):
        seen.append(seed)
        return {"acc": 0.9 + 0.01 * seed, "loss": 1.0 - 0.1 * seed}

    out = stats.over_seeds(run, [3, 4, 5])
    assert seen == [3, 4, 5]
    assert out["acc"].seeds == (3, 4, 5) and out["acc"].mean == pytest.approx(0.94)
    assert stats.over_seeds(lambda s: float(s), [1, 2]).mean == 1.5
    with pytest.raises(ValueError, match="distinct"):
        stats.over_seeds(lambda s: 0.0, [1, 1])


def test_paired_difference_removes_the_shared_seed_effect():
    a = stats.summarise([0.80, 0.90, 0.70], seeds=[0, 1, 2])
    b = stats.summarise([0.81, 0.91, 0.71], seeds=[0, 1, 2])
    d = stats.paired(a, b)
    assert d.mean == pytest.approx(0.01) and d.half < 1e-9  # the unpaired intervals overlap entirely
    assert a.hi > b.lo
    with pytest.raises(ValueError, match="seeds differ"):
        stats.paired(a, stats.summarise([0.8, 0.9, 0.7], seeds=[5, 6, 7]))


def test_binomial_error_and_wilson_interval():
    b = stats.binomial(0.96, 500)
    assert b.se == pytest.approx(math.sqrt(0.96 * 0.04 / 500))
    lo, hi = b.interval
    assert lo < 0.96 < hi and hi <= 1
    assert stats.binomial(1.0, 100).interval[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="proportion"):
        stats.binomial(96.0, 500)
    with pytest.raises(ValueError, match="positive integer"):
        stats.binomial(0.5, 0)


def test_stats_refuse_bad_values():
    with pytest.raises(ValueError, match="non-finite"):
        stats.summarise([0.5, float("nan")])
    with pytest.raises(TypeError, match="numbers"):
        stats.summarise(["0.5"])
    with pytest.raises(ValueError, match="seeds"):
        stats.summarise([0.5, 0.6], seeds=[0])


def test_stats_table_and_numpy_inputs():
    s = stats.summarise(np.array([0.5, 0.7], dtype=np.float32))
    df = stats.table({"method": s})
    assert df.loc["method", "seeds"] == 2 and df.loc["method", "mean"] == "0.600"


# --- glue helpers ------------------------------------------------------------------------------
def test_glue_turns_numpy_and_torch_scalars_into_python(monkeypatch):
    captured = {}
    import myst_nb

    monkeypatch.setattr(myst_nb, "glue", lambda name, value, display=False: captured.__setitem__(name, value))
    assert results.glue("a", np.float64(0.25)) == 0.25 and type(captured["a"]) is float
    assert type(results.glue("b", torch.tensor(3))) is int
    assert results.glue("c", "a sentence") == "a sentence"
    with pytest.raises(ValueError, match="scalar"):
        results.glue("d", torch.zeros(3))
    with pytest.raises(ValueError, match="identifier"):
        results.glue("bad name", 1.0)
    stats.glue_summary("k", stats.summarise([1.0, 2.0, 3.0]))
    assert captured["k_mean"] == 2.0 and captured["k_n"] == 3 and type(captured["k_half"]) is float


def test_bibliography_labels_are_author_year():
    from pybtex.database import parse_file
    from pybtex.plugin import find_plugin

    from capslib.tools import sphinx_bib

    sphinx_bib.register()
    bib = parse_file(str(paper.BIB))
    labels = dict(zip(bib.entries, find_plugin("pybtex.style.labels", "capsbook")().format_labels(bib.entries.values())))
    assert all(any(ch.isdigit() for ch in label) and not label.isupper() for label in labels.values()), labels
    assert len(set(labels.values())) == len(labels)
    sabour = [label for key, label in labels.items() if key.startswith("sabour")]
    assert sabour and all(label.startswith("Sabour et al. 2017") for label in sabour), sabour


def test_equivalence_reads_a_paired_difference_against_a_declared_margin():
    from scipy import stats as sps

    from capslib.book.stats import Equivalence, signed, summarise
    # the 90 % interval of three seeds: mean ± t(0.95, 2) * se
    d = summarise([-0.002, -0.006, -0.006])
    e = Equivalence(d, 0.01)
    lo, hi = e.tost_interval
    assert hi - d.mean == pytest.approx(sps.t.ppf(0.95, 2) * d.se)
    assert e.kind == "equivalent" and e.signs == (0, 3)          # inside ±0.01; the 95 % interval covers 0
    assert Equivalence(d, 0.005).kind == "unsettled"              # a tighter margin: too few seeds to say
    tight = summarise([-0.005, -0.0051, -0.0049])
    assert Equivalence(tight, 0.01).kind == "small"               # resolved, but inside the margin
    assert Equivalence(tight, 0.002).kind == "lower"              # resolved, and outside a small margin
    assert Equivalence(summarise([0.02, 0.021, 0.019]), 0.01).kind == "higher"
    assert "by more than the margin allows" in Equivalence(tight, 0.002).clause("a", "b")   # wholly beyond it
    straddles = Equivalence(summarise([-0.46, -0.52, -0.29, -0.16, -0.11]), 0.25)        # resolved; interval across -0.25
    assert straddles.kind == "lower" and "cannot say" in straddles.clause("a", "b")
    said = e.clause("detached", "full")
    assert said.startswith("is equivalent to full within the margin") and "lower in 3" in said and "±0.010" in said
    # the same verdicts in a few words, for a table cell
    assert e.phrase() == "equivalent within ±0.01 (lower in 3 of 3 seeds)"
    assert Equivalence(tight, 0.01).phrase() == "lower, within the margin (lower in 3 of 3 seeds)"
    assert Equivalence(tight, 0.002).phrase().startswith("lower, beyond the margin")
    assert straddles.phrase() == "lower, size unsettled (lower in 5 of 5 seeds)"
    assert Equivalence(d, 0.005).phrase().startswith("unsettled")
    assert Equivalence(summarise([0.01, -0.01, 0.0]), 0.05).phrase().endswith("(higher in 1 and lower in 1 of 3 seeds)")
    # and as a sentence in the caller's words
    assert Equivalence(tight, 0.002).verdict("A ahead", "B ahead") == \
        "B ahead, by more than the margin of ±0.2% (B ahead in 3 of 3 seeds, A ahead in 0)"
    assert straddles.verdict("A ahead", "B ahead", fmt=".2f").startswith(
        "B ahead; whether by more than the margin of ±0.25, these seeds cannot say")
    assert e.verdict("A", "B") == "equivalent within the margin of ±1.0% (A in 0 of 3 seeds, B in 3)"
    assert Equivalence(d, 0.005).verdict("A", "B").startswith("neither told apart nor equivalent")
    # a sign is printed only where the digits shown carry one; an identical difference says so
    assert (signed(-0.0004), signed(0.0004, "+.3f"), signed(-0.012, ".2f"), signed(-4e-5, ".1%")) == \
        ("0.000", "0.000", "-0.01", "0.0%")
    assert signed(-1e-5, ".2e") == "-1.00e-05" and signed(0.012) == "+0.012"
    assert "-0.000" not in Equivalence(summarise([0.0004, -0.0009, 0.0001]), 0.05).clause("a", "b")
    same = Equivalence(summarise([0.0, 0.0, 0.0]), 0.01)
    assert same.clause("detached", "full") == \
        "gives exactly the same value as full in every seed (detached − full = 0 in all 3 seeds)"
    with pytest.raises(ValueError, match="margin"):
        Equivalence(d, 0.0)
    with pytest.raises(ValueError, match="two seeds"):
        Equivalence(summarise([0.1]), 0.01)


def test_seeds_needed_is_the_paired_t_tests_sample_size_not_the_normal_approximation():
    """Textbook values of a two-sided paired t test at 5 % with 80 % power (G*Power: d = 0.5 needs 34 pairs, d = 1
    needs 10); with few seeds the normal approximation says too few (d = 3: 1 by it, 4 by the t test, whose power
    at 2 seeds is under a half)."""
    import math

    from scipy import stats as sps

    from capslib.book import stats

    assert stats.seeds_needed(0.5, 1.0) == 34 and stats.seeds_needed(1.0, 1.0) == 10
    assert stats.seeds_needed(-0.3, 0.1) == stats.seeds_needed(0.3, 0.1) == 4
    z = sps.norm.ppf(0.975) + sps.norm.ppf(0.8)
    assert math.ceil((z / 3.0) ** 2) == 1
    crit = sps.t.ppf(0.975, 1)
    assert sps.nct.sf(crit, 1, 3.0 * math.sqrt(2)) + sps.nct.cdf(-crit, 1, 3.0 * math.sqrt(2)) < 0.5
    assert stats.seeds_needed(0.1, 1.0) > math.ceil((z / 0.1) ** 2)       # even with many seeds, a little more
    for bad in ((0.0, 1.0), (1.0, 0.0), (1.0, float("nan"))):
        with pytest.raises(ValueError):
            stats.seeds_needed(*bad)
