"""make test's pool: start order, the waits between jobs, failures counted, bad arguments refused."""
import threading
import time
from pathlib import Path

import pytest

from capslib.tools import testpool


def _fake_run(events, seconds, fail=()):
    lock = threading.Lock()
    active = []

    def run(job, env):
        with lock:
            active.append(job)
            events.append(("start", job, tuple(active)))
        time.sleep(seconds.get(job, 0.01))
        with lock:
            active.remove(job)
            events.append(("end", job))
        return (1 if job in fail else 0), seconds.get(job, 0.01), Path("/dev/null")
    return run


def test_pool_starts_longest_first_and_never_runs_more_than_asked(monkeypatch, capsys):
    events = []
    monkeypatch.setattr(testpool, "_run", _fake_run(events, {"04": 0.2, "02": 0.05}))
    assert testpool.run(["01", "02", "unit", "04"], n_jobs=2, threads=1) == 0
    starts = [e[1] for e in events if e[0] == "start"]
    assert starts[:2] == ["unit", "04"]                      # the order of testpool.ORDER
    assert max(len(e[2]) for e in events if e[0] == "start") == 2
    assert sorted(starts) == ["01", "02", "04", "unit"]
    out = capsys.readouterr().out
    assert "nbval 04_" in out and "unit tests:" in out


def test_a_job_waits_for_the_jobs_it_reads_from(monkeypatch, capsys):
    events = []
    # chapter 2 is slow; chapter 7 is ready to start long before it ends but must wait for it
    monkeypatch.setattr(testpool, "_run", _fake_run(events, {"02": 0.3}))
    assert testpool.run(["02", "07", "01", "03", "scoreboard"], n_jobs=3, threads=1) == 0
    order = [(e[0], e[1]) for e in events]
    assert order.index(("end", "02")) < order.index(("start", "07"))
    for ch in ("01", "02", "03", "07"):
        assert order.index(("end", ch)) < order.index(("start", "scoreboard"))
    capsys.readouterr()


def test_failures_are_counted_and_the_other_jobs_still_run(monkeypatch, capsys):
    events = []
    monkeypatch.setattr(testpool, "_run", _fake_run(events, {}, fail={"03"}))
    assert testpool.run(["01", "03", "unit"], n_jobs=2, threads=1) == 1
    assert {e[1] for e in events if e[0] == "end"} == {"01", "03", "unit"}
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, message", [
    (dict(jobs=["99"]), "book/99_"),
    (dict(jobs=["01"], n_jobs=0), "n_jobs must be at least 1"),
    (dict(jobs=["01"], threads=0), "threads must be at least 1"),
])
def test_bad_arguments_are_refused_before_anything_runs(monkeypatch, kwargs, message):
    monkeypatch.setattr(testpool, "_run", lambda job, env: pytest.fail("nothing may run"))
    with pytest.raises(ValueError, match=message):
        testpool.run(**kwargs)


def test_commands_name_the_right_files():
    assert testpool.command("unit")[-1] == "tests"
    assert testpool.command("02")[-1].startswith("book/02_") and "--nbval-lax" in testpool.command("02")
    assert testpool.command("scoreboard")[-1] == "book/scoreboard.ipynb"
    assert testpool.schedule(["01", "04", "unit"]) == ["unit", "04", "01"]
    assert testpool.command("html")[-1] == "build-strict" and testpool.command("student")[-1] == "book-student"
    # the builds need no chapter: they come after the chapters in the order, before the scoreboard that waits
    assert testpool.schedule(["scoreboard", "student", "html", "01"]) == ["01", "html", "student", "scoreboard"]
    assert not testpool.AFTER.get("html") and not testpool.AFTER.get("student")
