"""Claims on trained numbers (capslib.book.claims) and the spread table that backs them."""
import json
import math

import nbformat
import pytest

from capslib.book import claims
from capslib.tools import spread


def test_check_passes_returns_and_raises_with_the_claim_named(monkeypatch):
    monkeypatch.delenv(claims.LOG_ENV, raising=False)
    assert claims.check("acc", 0.93, at_least=0.9) == pytest.approx(0.93)
    assert claims.check("zero", 0, at_most=0) == 0.0
    with pytest.raises(AssertionError, match=r"claim 'acc' does not hold: 0\.8 is not >= 0\.9"):
        claims.check("acc", 0.8, at_least=0.9)
    with pytest.raises(AssertionError, match="is not > 0"):
        claims.check("gap", 0.0, above=0.0)  # strict
    with pytest.raises(AssertionError):
        claims.check("nan never holds", math.nan, below=1.0)


def test_check_rejects_bad_bounds_and_values(monkeypatch):
    monkeypatch.delenv(claims.LOG_ENV, raising=False)
    with pytest.raises(ValueError, match="exactly one of"):
        claims.check("x", 1.0)
    with pytest.raises(ValueError, match="exactly one of"):
        claims.check("x", 1.0, above=0, below=2)
    with pytest.raises(TypeError, match="value must be a number; got str"):
        claims.check("x", "0.9", above=0)


def test_check_logs_instead_of_raising_in_a_spread_run(tmp_path, monkeypatch):
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv(claims.LOG_ENV, str(log))
    claims.check("a", 0.5, at_least=0.9)  # does not raise: the spread run measures it
    claims.check("b", 2, below=3)
    got = claims.read_log(log)
    assert [(c["name"], c["holds"]) for c in got] == [("a", False), ("b", True)]
    assert got[0]["bound"] == "at_least" and got[0]["limit"] == 0.9


def test_summarise_finds_the_worst_run_and_thread_differences():
    runs = {
        "seed 0, 2 threads": {"seed": 0, "threads": 2, "chapters": {"02": {"claims": [
            {"name": "acc", "value": 0.95, "bound": "at_least", "limit": 0.9}]}}},
        "seed 1, 2 threads": {"seed": 1, "threads": 2, "chapters": {"02": {"claims": [
            {"name": "acc", "value": 0.91, "bound": "at_least", "limit": 0.9}]}}},
        "seed 1, 1 thread": {"seed": 1, "threads": 1, "chapters": {"02": {"claims": [
            {"name": "acc", "value": 0.92, "bound": "at_least", "limit": 0.9}]}}},
    }
    d = spread.summarise(runs)["acc"]
    assert d["worst_run"] == "seed 1, 2 threads" and d["worst_margin"] == pytest.approx(0.01)
    assert d["n"] == 3 and d["seeds"] == 2 and d["holds_in_every_run"]
    assert d["max_thread_difference"] == pytest.approx(0.01)
    assert "| acc | ≥ 0.9 | 3 (2, 1) |" in spread.markdown({"claims": {"acc": d}})
    assert d["processors"] == 1 and d["max_processor_difference"] is None


def test_summarise_keeps_processors_apart():
    cpu = "Some CPU, AVX2 kernels"
    runs = {
        "seed 0, 2 threads": {"seed": 0, "threads": 2, "chapters": {"02": {"claims": [
            {"name": "acc", "value": 0.95, "bound": "at_least", "limit": 0.9}]}}},
        spread.run_key(0, 2, cpu): {"seed": 0, "threads": 2, "cpu": cpu, "chapters": {"02": {"claims": [
            {"name": "acc", "value": 0.93, "bound": "at_least", "limit": 0.9}]}}},
        spread.run_key(0, 1, cpu): {"seed": 0, "threads": 1, "cpu": cpu, "chapters": {"02": {"claims": [
            {"name": "acc", "value": 0.935, "bound": "at_least", "limit": 0.9}]}}},
    }
    assert spread.run_key(0, 1, cpu) == "seed 0, 1 thread, Some CPU, AVX2 kernels"
    d = spread.summarise(runs)["acc"]
    assert d["n"] == 3 and d["seeds"] == 1 and d["processors"] == 2
    # threads compared on one processor only; the processors compared at the same seed and threads
    assert d["max_thread_difference"] == pytest.approx(0.005)
    assert d["max_processor_difference"] == pytest.approx(0.02)
    assert d["worst_run"] == spread.run_key(0, 2, cpu)
    assert spread.cpu_name().endswith(" kernels")


def test_glue_claim_glues_the_spread_and_counts_distinct_values(tmp_path, monkeypatch):
    import myst_nb

    cpu = "Some CPU, AVX2 kernels"
    runs = {spread.run_key(s, t, c): {"seed": s, "threads": t, **({"cpu": c} if c else {}), "chapters": {
        "03": {"claims": [{"name": "share", "value": v, "bound": "above", "limit": 0.8}]}}}
        for (s, t, c), v in {(0, 2, None): 1.0, (0, 1, None): 1.0, (1, 2, None): 0.9, (1, 2, cpu): 0.9}.items()}
    path = tmp_path / "spread.json"
    path.write_text(json.dumps({"runs": runs, "claims": spread.summarise(runs)}))
    glued = {}
    monkeypatch.setattr(myst_nb, "glue", lambda name, value, display=True: glued.__setitem__(name, value))
    d = spread.glue_claim("k", "share", path)
    assert d["distinct"] == 2 and glued["k_distinct"] == 2 and glued["k_runs"] == 4 and glued["k_seeds"] == 2
    assert glued["k_processors"] == 2 and glued["k_processor_types"] == "2 processor types"
    assert glued["k_min"] == pytest.approx(0.9) and glued["k_limit"] == pytest.approx(0.8)
    one = {k: v for k, v in runs.items() if "cpu" not in v}
    path.write_text(json.dumps({"runs": one, "claims": spread.summarise(one)}))
    spread.glue_claim("k", "share", path)
    assert glued["k_processor_types"] == "1 processor type" and glued["k_distinct"] == 2


def test_by_seed_pairs_claims_of_one_run_per_seed_at_one_thread_count(tmp_path):
    from capslib.book.spread import by_seed

    old, new = "Old CPU, AVX2 kernels", "New CPU, AVX512 kernels"

    def run(seed, threads, cpu, values):
        return spread.run_key(seed, threads, cpu), {"seed": seed, "threads": threads, "cpu": cpu, "chapters": {
            "05": {"claims": [{"name": n, "value": v, "bound": "above", "limit": 0.0} for n, v in values.items()]}}}

    runs = dict([run(0, 2, old, {"a": 1.0, "b": 2.0}), run(0, 2, new, {"a": 1.5, "b": 2.5}),
                 run(1, 2, old, {"a": 3.0, "b": 4.0}), run(0, 1, new, {"a": 9.0, "b": 9.0}),
                 run(2, 2, new, {"a": 5.0})])          # seed 2 lacks b: left out
    path = tmp_path / "spread.json"
    path.write_text(json.dumps({"runs": runs, "claims": spread.summarise(runs),
                                "processors": {old: "2026-01-01 10:00", new: "2026-02-01 10:00"}}))
    # seed 0 from the processor measured last; the one-thread run is another thread count
    assert by_seed(["a", "b"], threads=2, path=path) == {0: {"a": 1.5, "b": 2.5}, 1: {"a": 3.0, "b": 4.0}}
    assert by_seed(["a"], threads=1, path=path) == {0: {"a": 9.0}}
    assert sorted(by_seed(["a"], path=path)) == [0, 1, 2]
    with pytest.raises(KeyError, match="make spread"):
        by_seed(["a", "c"], path=path)


def _notebook_claims() -> dict[str, tuple[str, str, float]]:
    """Every claims.check(...) call in the chapters: name -> (notebook, bound, limit)."""
    return {k: (d["chapter"], d["bound"], d["limit"]) for k, d in spread.notebook_claims().items()}


def test_no_bare_assert_on_a_trained_number_is_left_in_a_chapter():
    made = _notebook_claims()
    assert len(made) >= 30, len(made)
    for nb_path in spread.chapters():
        for cell in nbformat.read(nb_path, as_version=4).cells:
            if cell.cell_type == "code":
                for line in cell.source.splitlines():
                    # what is still asserted plainly is a derivation or a fixed-seed toy, never a score
                    assert not ("assert" in line and any(w in line for w in ("acc", "entropy", "mse", "sparsity"))
                                and "assert_close" not in line), (nb_path.name, line)


def test_every_claim_has_a_measured_spread_and_its_bound_sits_below_the_worst_run():
    table = json.loads(spread.SPREAD_FILE.read_text())
    made = _notebook_claims()
    measured = table["claims"]
    missing = sorted(set(made) - set(measured))
    assert not missing, f"claims with no spread measured (run `make spread`): {missing}"
    for name, (chapter, bound, limit) in made.items():
        d = measured[name]
        assert (d["bound"], d["limit"]) == (bound, limit), f"{name}: bound changed since the spread was measured"
        assert d["seeds"] >= 5, f"{name}: measured over {d['seeds']} seeds"
        assert d["holds_in_every_run"], f"{name}: fails in {d['worst_run']} ({d['worst_value']})"
        threads = {table["runs"][k]["threads"] for k in d["values"]}
        wanted = {2} if chapter[:2] in TWO_THREADS_ONLY else {1, 2}
        assert threads >= wanted, f"{name}: measured at {sorted(threads)} threads only"
    for ch in TWO_THREADS_ONLY:  # strict: the entry goes once the chapter is measured at one thread too
        runs = [e for e in table["runs"].values() if any(c[:2] == ch for c in e["chapters"])]
        assert not any(e["threads"] == 1 for e in runs), f"chapter {ch} has 1-thread runs: remove it from the list"


# Chapters whose current version was measured at 2 threads only (a session that ran out of machine time
# for the 1-thread runs names them here); every other chapter is measured at 1 and 2 threads.
# Empty since 2026-11-23 (morning): chapters 2 and 4, the last two listed, were measured at 1 thread too.
# make test runs every chapter at 1 thread (two at a time), so a chapter listed here is tested at a thread
# count its claims were not measured at.
TWO_THREADS_ONLY: set[str] = set()


def test_a_bound_that_is_not_a_literal_is_refused_with_the_claim_named(tmp_path):
    import nbformat.v4 as v4
    nb = v4.new_notebook(cells=[v4.new_code_cell('claims.check("99 a share", x, above=cfg.margin)')])
    path = tmp_path / "99_toy.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match=r"99_toy.ipynb: claim '99 a share': its bound must be a literal number.*cfg\.margin"):
        spread.notebook_claims([path])
    nbformat.write(v4.new_notebook(cells=[v4.new_code_cell('claims.check("99 a share", x, above=0.1)')]), path)
    assert spread.notebook_claims([path]) == {"99 a share": {"chapter": "99_toy", "bound": "above", "limit": 0.1}}


def test_rebound_rejudges_moved_bounds_and_drops_withdrawn_claims(tmp_path):
    import nbformat.v4 as v4
    path = tmp_path / "99_toy.ipynb"
    nbformat.write(v4.new_notebook(cells=[v4.new_code_cell('claims.check("99 kept", x, above=0.5)')]), path)
    run = lambda seed, kept, gone: {"seed": seed, "threads": 2, "chapters": {"99_toy": {"claims": [  # noqa: E731
        {"name": "99 kept", "value": kept, "bound": "above", "limit": 0.9},
        {"name": "99 withdrawn", "value": gone, "bound": "above", "limit": 0.0}]}}}
    table = tmp_path / "spread.json"
    table.write_text(json.dumps({"runs": {"seed 0": run(0, 0.8, 0.1), "seed 1": run(1, 0.7, -0.1)}}))
    out = spread.rebound(table, [path])
    assert set(out["claims"]) == {"99 kept"} and json.loads(table.read_text())["claims"].keys() == {"99 kept"}
    kept = out["claims"]["99 kept"]
    assert (kept["bound"], kept["limit"]) == ("above", 0.5) and kept["holds_in_every_run"] and kept["n"] == 2
