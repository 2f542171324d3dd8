"""Comparisons with uncertainty: results over seeds, intervals, paired differences, binomial errors.

A chapter that compares two methods or settings runs each over the same seeds
(:func:`over_seeds`), shows :func:`table` (mean ± half-width of a 95 % Student-t interval, seed
count, lowest and highest seed) and, for two methods, :func:`paired` (the per-seed difference, which
removes what the seeds share). A single run's test accuracy comes with :func:`binomial`, the
sampling error of a test set of that size. :func:`glue_summary` hands any of these to the prose.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence


def _t_quantile(level: float, dof: int) -> float:
    from scipy import stats as sps

    return float(sps.t.ppf(0.5 + level / 2, dof))


def signed(value: float, fmt: str = ".3f") -> str:
    """``value`` formatted with ``fmt`` and its sign (``+0.012``, ``-0.012``); a value that rounds to zero
    at ``fmt`` is written without one (``0.000``), since its sign is below the precision shown."""
    fmt = fmt.lstrip("+")
    text = format(value, "+" + fmt)
    mantissa = text.split("e")[0]
    return text[1:] if not any(ch in "123456789" for ch in mantissa) else text


def _finite_floats(values, what: str) -> list[float]:
    out = []
    for v in values:
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{what}: expected numbers, got {type(v).__name__} ({v!r})")
        if not math.isfinite(v):
            raise ValueError(f"{what}: got a non-finite value {v!r}")
        out.append(float(v))
    return out


@dataclass(frozen=True)
class Summary:
    """Mean and spread of one quantity over runs (seeds). ``half`` is the half-width of the
    ``level`` Student-t interval of the mean (0 for a single run: no interval can be given)."""

    values: tuple[float, ...]
    seeds: tuple[int, ...] = field(default=())
    level: float = 0.95

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / self.n

    @property
    def sd(self) -> float:
        if self.n < 2:
            return 0.0
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (self.n - 1))

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(self.n)

    @property
    def half(self) -> float:
        return _t_quantile(self.level, self.n - 1) * self.se if self.n >= 2 else 0.0

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    def text(self, fmt: str = ".3f") -> str:
        """``0.912 ± 0.011 (n = 3, 95% t)``: the ± is the half-width of the ``level`` Student-t interval; percent
        formats (``.1%``) keep the ``%`` on both numbers."""
        return f"{format(self.mean, fmt)} ± {format(self.half, fmt)} (n = {self.n}, {self.level:.0%} t)"

    def __format__(self, spec: str) -> str:
        return self.text(spec or ".3f")


def summarise(values: Iterable, seeds: Sequence[int] = (), level: float = 0.95) -> Summary:
    """A :class:`Summary` of ``values`` (one per seed); ``seeds`` are recorded if given."""
    vals = _finite_floats(list(values), "summarise")
    if not vals:
        raise ValueError("summarise: need at least one value")
    if seeds and len(seeds) != len(vals):
        raise ValueError(f"summarise: {len(vals)} values but {len(seeds)} seeds")
    if not 0 < level < 1:
        raise ValueError(f"summarise: level must lie in (0, 1), got {level}")
    return Summary(tuple(vals), tuple(int(s) for s in seeds), level)


def over_seeds(fn: Callable[[int], float | dict], seeds: Sequence[int], level: float = 0.95):
    """Run ``fn(seed)`` for every seed. ``fn`` returns a number or a dict of numbers; the result is a
    :class:`Summary` or a dict of them (same keys), each remembering the seeds."""
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"over_seeds: seeds must be distinct and non-empty, got {seeds}")
    runs = [fn(s) for s in seeds]
    if all(isinstance(r, dict) for r in runs):
        names = list(runs[0])
        if any(list(r) != names for r in runs):
            raise ValueError("over_seeds: every run must return the same keys")
        return {k: summarise([r[k] for r in runs], seeds, level) for k in names}
    return summarise(runs, seeds, level)


def over_seeds_for(keys: Sequence, fn: Callable[[object, int], float | dict], seeds: Sequence[int],
                   level: float = 0.95, isolated: bool = False) -> dict:
    """``{key: over_seeds(lambda s: fn(key, s), seeds)}`` for every key (a setting, a method); with ``isolated``
    every (key, seed) run is one task of :func:`capslib.book.isolate.map_isolated`, so that as many run at once
    as there are workers, whatever the number of seeds."""
    keys, seeds = list(keys), list(seeds)
    if len(set(keys)) != len(keys):
        raise ValueError(f"over_seeds_for: keys must be distinct, got {keys}")
    jobs = [(k, s) for k in keys for s in seeds]
    if isolated:
        from .isolate import map_isolated
        done = dict(zip(jobs, map_isolated(lambda job: fn(*job), jobs)))
    else:
        done = {job: fn(*job) for job in jobs}
    return {k: over_seeds(lambda s, k=k: done[k, s], seeds, level) for k in keys}


def paired(a: Summary, b: Summary) -> Summary:
    """The per-seed difference ``b - a`` of two summaries over the same seeds (seeds must match, in
    order). Its interval excludes 0 when one method beats the other on these seeds beyond their
    shared variation."""
    if a.n != b.n:
        raise ValueError(f"paired: {a.n} runs against {b.n}")
    if a.seeds and b.seeds and a.seeds != b.seeds:
        raise ValueError(f"paired: seeds differ ({a.seeds} vs {b.seeds}); pair runs on the same seeds")
    return Summary(tuple(y - x for x, y in zip(a.values, b.values)), a.seeds or b.seeds, a.level)


@dataclass(frozen=True)
class Binomial:
    """A proportion measured on ``n`` independent test items: standard error and Wilson interval."""

    p: float
    n: int
    level: float = 0.95

    @property
    def se(self) -> float:
        return math.sqrt(self.p * (1 - self.p) / self.n)

    @property
    def interval(self) -> tuple[float, float]:
        from scipy import stats as sps

        z = float(sps.norm.ppf(0.5 + self.level / 2))
        denom = 1 + z * z / self.n
        centre = (self.p + z * z / (2 * self.n)) / denom
        half = z * math.sqrt(self.p * (1 - self.p) / self.n + z * z / (4 * self.n * self.n)) / denom
        return centre - half, centre + half

    def text(self, fmt: str = ".3f") -> str:
        return f"{format(self.p, fmt)} ± {format(self.se, fmt)} (binomial s.e., {self.n:,} test images)"


def binomial(p: float, n: int, level: float = 0.95) -> Binomial:
    """The sampling error of an accuracy ``p`` measured on ``n`` test images."""
    (p,) = _finite_floats([p], "binomial")
    if not 0 <= p <= 1:
        raise ValueError(f"binomial: p must be a proportion in [0, 1], got {p}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"binomial: n must be a positive integer (test images), got {n!r}")
    return Binomial(p, n, level)


def seeds_needed(delta: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """The fewest seeds ``n`` (at least 2) at which a two-sided paired t test at level ``alpha`` detects a mean
    difference ``delta`` with probability ``power``, when the per-seed differences spread with standard deviation
    ``sd``: the statistic follows a noncentral t with ``n - 1`` degrees of freedom and noncentrality
    ``delta sqrt(n) / sd``. The normal approximation ``((z_{1-alpha/2} + z_power) sd / delta)^2`` is where the
    search starts; with few seeds the t distribution's heavy tails need more than it says."""
    from scipy import stats as sps

    (delta, sd) = _finite_floats([delta, sd], "seeds_needed")
    if delta == 0 or sd <= 0 or not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"seeds_needed: need delta != 0, sd > 0 and alpha, power in (0, 1); got {delta}, {sd}, "
                         f"{alpha}, {power}")
    effect = abs(delta) / sd
    z = float(sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power))

    def achieved(n: int) -> float:
        crit = float(sps.t.ppf(1 - alpha / 2, n - 1))
        nc = effect * math.sqrt(n)
        return float(sps.nct.sf(crit, n - 1, nc) + sps.nct.cdf(-crit, n - 1, nc))

    n = max(2, math.ceil((z / effect) ** 2))
    while achieved(n) < power:
        n += 1
    return n


def table(summaries: dict, fmt: str = ".3f"):
    """A DataFrame, one row per summary: mean, ± (95 % t half-width), seeds, lowest, highest (which of the two
    is the worse depends on the quantity)."""
    import pandas as pd

    rows = []
    for name, s in summaries.items():
        if not isinstance(s, Summary):
            raise TypeError(f"table: {name!r} is {type(s).__name__}, expected a Summary")
        rows.append({"": name, "mean": format(s.mean, fmt), "± (95% CI)": format(s.half, fmt), "seeds": s.n,
                     "lowest": format(s.min, fmt), "highest": format(s.max, fmt)})
    return pd.DataFrame(rows).set_index("")


def glue_summary(key: str, s: Summary | Binomial) -> None:
    """Glue ``<key>_mean``, ``_half``, ``_lo``, ``_hi``, ``_sd``, ``_min``, ``_max`` (floats) and
    ``<key>_n`` (int) of a Summary; ``<key>_p``, ``_se``, ``_lo``, ``_hi``, ``_n`` of a Binomial."""
    from myst_nb import glue

    if isinstance(s, Binomial):
        lo, hi = s.interval
        items = {"p": s.p, "se": s.se, "lo": lo, "hi": hi}
        n = s.n
    elif isinstance(s, Summary):
        items = {"mean": s.mean, "half": s.half, "lo": s.lo, "hi": s.hi, "sd": s.sd, "min": s.min, "max": s.max}
        n = s.n
    else:
        raise TypeError(f"glue_summary: expected a Summary or Binomial, got {type(s).__name__}")
    for name, v in items.items():
        glue(f"{key}_{name}", float(v), display=False)
    glue(f"{key}_n", int(n), display=False)


# ----------------------------------------------------------------------------- equivalence

@dataclass(frozen=True)
class Equivalence:
    """A paired difference ``d`` (one value per seed) read against a margin of practical equivalence
    ``margin`` declared before the run, by two one-sided t tests at ``alpha`` each: the difference is
    *equivalent* (inside ``±margin``) when the ``1 - 2 alpha`` interval of its mean lies inside the
    margin, and *resolved* (not zero) when the two-sided ``1 - alpha`` interval (the usual 95 %)
    excludes 0. ``kind`` combines both:

    - ``"equivalent"``: inside the margin, and no difference resolved;
    - ``"small"``: a difference resolved, but inside the margin (different, not in practice);
    - ``"higher"`` / ``"lower"``: a difference resolved that the margin does not contain (the
      sentence of :meth:`clause` says "by more than the margin" only when the whole interval lies
      beyond it);
    - ``"unsettled"``: neither: the interval is too wide for this margin and these seeds.
    """
    d: Summary
    margin: float
    alpha: float = 0.05

    def __post_init__(self):
        if not self.margin > 0:
            raise ValueError(f"equivalence: the margin must be positive, got {self.margin}")
        if not 0 < self.alpha < 0.5:
            raise ValueError(f"equivalence: alpha must lie in (0, 0.5), got {self.alpha}")
        if self.d.n < 2:
            raise ValueError("equivalence: needs at least two seeds (a single run has no interval)")

    @property
    def tost_interval(self) -> tuple[float, float]:
        half = _t_quantile(1 - 2 * self.alpha, self.d.n - 1) * self.d.se
        return self.d.mean - half, self.d.mean + half

    @property
    def interval(self) -> tuple[float, float]:
        half = _t_quantile(1 - self.alpha, self.d.n - 1) * self.d.se
        return self.d.mean - half, self.d.mean + half

    @property
    def equivalent(self) -> bool:
        lo, hi = self.tost_interval
        return -self.margin < lo and hi < self.margin

    @property
    def resolved(self) -> bool:
        lo, hi = self.interval
        return lo > 0 or hi < 0

    @property
    def kind(self) -> str:
        if self.equivalent:
            return "small" if self.resolved else "equivalent"
        if self.resolved:
            return "higher" if self.d.mean > 0 else "lower"
        return "unsettled"

    @property
    def signs(self) -> tuple[int, int]:
        """Seeds with a positive and with a negative difference."""
        return sum(v > 0 for v in self.d.values), sum(v < 0 for v in self.d.values)

    def phrase(self, fmt: str = ".2f") -> str:
        """The verdict in a few words for a table cell (the sign of the difference, then the seeds'
        signs), e.g. "lower, beyond the margin (lower in 3 of 3 seeds)"; :meth:`clause` gives the numbers."""
        lo, hi = self.tost_interval
        pos, neg = self.signs
        word = {"equivalent": f"equivalent within ±{format(self.margin, fmt)}",
                "small": f"{'higher' if self.d.mean > 0 else 'lower'}, within the margin",
                "higher": "higher, beyond the margin" if lo > self.margin else "higher, size unsettled",
                "lower": "lower, beyond the margin" if hi < -self.margin else "lower, size unsettled",
                "unsettled": "unsettled"}[self.kind]
        n = self.d.n
        if self.d.mean > 0:
            return f"{word} (higher in {pos} of {n} seeds)"
        if self.d.mean < 0:
            return f"{word} (lower in {neg} of {n} seeds)"
        return f"{word} (higher in {pos} and lower in {neg} of {n} seeds)"

    def verdict(self, ahead: str, behind: str, fmt: str = ".1%") -> str:
        """The verdict as a sentence in the caller's words, ``ahead`` for a positive difference and ``behind``
        for a negative one, with the margin (formatted with ``fmt``) and the seeds on each side, counted from
        the side the sentence names (for a verdict that names no side, in both sides' words)."""
        lo, hi = self.tost_interval
        pos, neg = self.signs
        m = f"±{format(self.margin, fmt)}"
        said = {"higher": f"{ahead}, by more than the margin of {m}" if lo > self.margin else
                          f"{ahead}; whether by more than the margin of {m}, these seeds cannot say",
                "lower": f"{behind}, by more than the margin of {m}" if hi < -self.margin else
                         f"{behind}; whether by more than the margin of {m}, these seeds cannot say",
                "small": f"{ahead if self.d.mean > 0 else behind}, by less than the margin of {m}",
                "equivalent": f"equivalent within the margin of {m}",
                "unsettled": f"neither told apart nor equivalent within the margin of {m} with these seeds"}[self.kind]
        n = self.d.n
        if self.kind == "equivalent" or self.kind == "unsettled" or self.d.mean == 0:
            return f"{said} ({ahead} in {pos} of {n} seeds, {behind} in {neg})"
        (named, agree), (unnamed, other) = ((ahead, pos), (behind, neg)) if self.d.mean > 0 else ((behind, neg), (ahead, pos))
        return f"{said} ({named} in {agree} of {n} seeds, {unnamed} in {other})"

    def clause(self, who: str, ref: str, fmt: str = ".3f", ref_words: str | None = None) -> str:
        """``who`` against ``ref`` in words (``ref_words`` in the sentence if given), with the numbers
        that decide it."""
        lo, hi = self.tost_interval
        pos, neg = self.signs
        n = self.d.n
        if all(v == 0 for v in self.d.values):   # no interval to read: the same value in every seed
            return f"gives exactly the same value as {ref_words or ref} in every seed ({who} − {ref} = 0 in all {n} seeds)"
        numbers = (f"{who} − {ref}: {signed(self.d.mean, fmt)}, {1 - 2 * self.alpha:.0%} interval "
                   f"{signed(lo, fmt)} to {signed(hi, fmt)} against a margin of ±{format(self.margin, fmt)}; "
                   f"higher in {pos} of {n} seeds, lower in {neg}")
        ref = ref_words or ref
        said = {"equivalent": f"is equivalent to {ref} within the margin",
                "small": f"is {'higher' if self.d.mean > 0 else 'lower'} than {ref}, by less than the margin",
                "higher": f"is higher than {ref}, by more than the margin allows" if lo > self.margin else
                          f"is higher than {ref}; whether by more than the margin, these seeds cannot say",
                "lower": f"is lower than {ref}, by more than the margin allows" if hi < -self.margin else
                         f"is lower than {ref}; whether by more than the margin, these seeds cannot say",
                "unsettled": f"cannot be told from {ref} or called equivalent with these seeds"}[self.kind]
        return f"{said} ({numbers})"
