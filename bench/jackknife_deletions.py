"""The delete-one-group jackknife of KL_min by Newton steps against the exact re-solves.

    python bench/jackknife_deletions.py [--records] [--harness DIR ...]

``iproj.group_jackknife`` gets KL_min with each prompt group deleted by a solve from lambda = 0
per deletion (``deletions="exact"``, G more solves per step pair, what eta used before), or by
Newton steps on the deleted dual from the whole sample's tilt: one (``"one_step"``), two
(``"two_step"``), or two with the samples whose second step still expected a gain beyond
``STEP_TOL`` of the jackknife's SE solved from scratch (``"checked"``, the default). This
prints, for each against the exact solves, what the estimate of eta takes from them: the
deleted values, Quenouille's KL_jk, the jackknife's SE of KL_jk and eta's 95 % interval.

* synthetic samples: G = 2..8 prompt groups of 8 rollouts (+ 4 held-out completions of pi_t
  where two-sided), three features, the log-ratio r = s (0.4 z_1 + 0.3 noise) with s = 0.3
  (mild) to 3 and 6 (sharpened: the importance weights exp(-r) of a group carried by a few
  rows); and collapse-like ones (most groups one completion repeated, binary features, the
  others' log-ratios spread over tens of nats: tests/unit/test_jackknife.py's);
* ``--records``: every priced step pair of the bundled examples' reports (what
  ``paired_estimates`` is handed when ``reward-lens report`` builds them);
* ``--harness DIR``: the step pairs of the truth harness's cached runs (``tools/truth.py
  --cache DIR``), their records priced as the harness prices them.

Per set: the worst deleted value's error over the spread of the deleted values (max over
pairs of max_g |K1_(-g) - K_(-g)| / (max_g K_(-g) - min_g K_(-g))); the error in KL_jk in
units of its jackknife SE (median, max); the relative error in that SE; and for the records
the largest move of an endpoint of eta's interval, in units of eta's SE, and the run-level
interval both ways.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from reward_lens.measure.efficiency import eta as _eta  # noqa: E402
from reward_lens.measure.efficiency.iproj import group_jackknife  # noqa: E402


WAYS = ("one_step", "two_step", "checked")


def _stats(full, exact, step, g):
    """Per pair: (deleted error / spread, KL_jk error / SE, SE relative error)."""
    spread = exact.max(axis=1) - exact.min(axis=1)
    err = np.abs(step - exact).max(axis=1)
    jk_e = g * full - (g - 1) * exact.mean(axis=1)
    jk_s = g * full - (g - 1) * step.mean(axis=1)

    def se(v):
        dev = v - v.mean(axis=1, keepdims=True)
        return np.sqrt((g - 1) / g * (dev ** 2).sum(axis=1))

    se_e, se_s = se(exact), se(step)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.where(spread > 0, err / spread, 0.0), np.where(se_e > 0, np.abs(jk_s - jk_e) / se_e, 0.0),
                np.where(se_e > 0, np.abs(se_s / se_e - 1.0), 0.0))


def _line(name, rel, jk, se, extra=""):
    return (f"{name:<34s} deleted err/spread max {rel.max():.1e}; KL_jk err/SE median {np.median(jk):.1e} "
            f"max {jk.max():.1e}; SE rel err max {se.max():.1e}{extra}")


def synthetic(pairs: int = 200) -> None:
    rng = np.random.default_rng(0)
    print(f"synthetic: {pairs} samples each, 8 rollouts (+ 4 held-out) per group, 3 features")
    for s in (0.3, 3.0, 6.0):
        for g in (2, 3, 4, 8):
            for two in (False, True):
                h = 4 if two else 0
                codes = np.repeat(np.arange(g), 8 + h)
                side = np.tile(np.r_[np.zeros(8, bool), np.ones(h, bool)], g) if two else None
                z = rng.normal(size=(pairs, len(codes), 3))
                r = s * (0.4 * z[:, :, 0] + 0.3 * rng.normal(size=(pairs, len(codes))))
                t0 = time.perf_counter()
                a = group_jackknife(z, r, codes, g, side, "exact")
                ms = {"exact": 1e3 * (time.perf_counter() - t0)}
                for how in WAYS:
                    t0 = time.perf_counter()
                    b = group_jackknife(z, r, codes, g, side, how)
                    ms[how] = 1e3 * (time.perf_counter() - t0)
                    assert np.array_equal(a.full, b.full)
                    rel, jk, se = _stats(a.full, a.deleted, b.deleted, g)
                    solved = f", {100 * b.solved.mean():.0f} % solved" if how == "checked" else ""
                    print(_line(f"  s={s:g} G={g} {'two' if two else 'one'}-sided {how}", rel, jk, se,
                                f"; {ms[how]:.0f} ms ({ms['exact']:.0f} ms exact){solved}"))


SOLVED: list = []  # per call of group_jackknife with deletions="checked": (pairs solved from scratch, pairs)


def _counted(*a, **kw):
    jk = group_jackknife(*a, **kw)
    if (a[5:] or (kw.get("deletions"),))[0] == "checked":
        SOLVED.append((int(jk.solved.sum()), len(jk.solved)))
    return jk


def collapsing(pairs: int = 300) -> None:
    from tests.unit.test_jackknife import _collapsing

    rng = np.random.default_rng(0)
    z, r, codes = _collapsing(rng, pairs)
    a = group_jackknife(z, r, codes, 8, None, "exact")
    keep = (a.deleted.max(axis=1) > a.deleted.min(axis=1))  # every group one completion: nothing to delete
    z, r = z[keep], r[keep]
    a = group_jackknife(z, r, codes, 8, None, "exact")
    print(f"collapse-like: {len(z)} samples of 8 groups of 8 rollouts, 4 binary features")
    for how in WAYS:
        b = group_jackknife(z, r, codes, 8, None, how)
        rel, jk, se = _stats(a.full, a.deleted, b.deleted, 8)
        solved = f", {100 * b.solved.mean():.0f} % solved" if how == "checked" else ""
        print(_line(f"  {how}", rel, jk, se, solved))


def _estimates(items) -> list:
    """eta's estimates both ways, and the stats of the deletions, for items of ``paired_estimates``."""
    SOLVED.clear()
    _eta.group_jackknife = _counted
    try:
        return [_eta.paired_estimates(items, deletions=how) for how in ("exact", *WAYS)]
    finally:
        _eta.group_jackknife = group_jackknife


def _eta_lines(name, exact, *others):
    for how, step in zip(WAYS, others):
        _eta_line(f"{name} {how}", exact, step)


def _eta_line(name, exact, step):
    moves, se_rel, jk = [], [], []
    for e, s in zip(exact, step):
        if not np.isfinite(e.se) or e.se <= 0:
            continue
        (lo_e, hi_e), (lo_s, hi_s) = e.interval(), s.interval()
        moves.append(max(abs(lo_s - lo_e), abs(hi_s - hi_e)) / e.se)
        se_rel.append(abs(s.se / e.se - 1.0))
        kse = np.sqrt(e.cov[0, 0])
        jk.append(abs(s.kl_min_debiased - e.kl_min_debiased) / kse if kse > 0 else 0.0)
    moves, se_rel, jk = np.array(moves), np.array(se_rel), np.array(jk)
    run_e, run_s = _eta.run_level(exact), _eta.run_level(step)
    solved = (f" ({sum(s for s, _ in SOLVED)} of {sum(n for _, n in SOLVED)} solved from scratch)"
              if name.endswith("checked") else "")
    print(f"{name:<34s} {len(moves)} pairs{solved}: KL_jk err/SE median {np.median(jk):.1e} max {jk.max():.1e}; eta SE rel "
          f"err max {se_rel.max():.1e}; interval endpoints moved by at most {moves.max():.1e} SE (median "
          f"{np.median(moves):.1e}); run level {run_e.eta_debiased:.4f} [{run_e.interval()[0]:.4f}, "
          f"{run_e.interval()[1]:.4f}] -> {run_s.eta_debiased:.4f} [{run_s.interval()[0]:.4f}, "
          f"{run_s.interval()[1]:.4f}]")


def _captured(build) -> list:
    """The items ``paired_estimates`` is handed while ``build()`` prices a record."""
    got = []
    real = _eta.paired_estimates

    def capture(items, deletions=None):
        got.extend(items)
        return real(items, deletions)

    _eta.paired_estimates = capture
    try:
        build()
    finally:
        _eta.paired_estimates = real
    return got


def records() -> None:
    from reward_lens.record import open_run
    from reward_lens.report import build_report

    print("the bundled examples (every step pair a report prices)")
    for name in ("long", "short", "tapped", "paired"):
        items = _captured(lambda: build_report(open_run(REPO / "tests" / "fixtures" / "grpo_run" / name)))
        if not items:
            print(f"  {name}: no paired estimate")
            continue
        _eta_lines(f"  {name}", *_estimates(items))


def harness(path: Path) -> None:
    import truth

    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run

    print(f"the truth harness's records ({path})")
    for name in ("moderate", "collapse"):
        work = path / name
        if not (work / "record").exists():
            print(f"  {name}: no record in {work}")
            continue
        *_, basis = truth._setup(truth.REGIMES[name])
        run = open_run(work / "record")
        items = _captured(lambda: price_run(run, steps_from_run(run, basis), ledger="paired"))
        _eta_lines(f"  {name}", *_estimates(items))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", action="store_true")
    ap.add_argument("--harness", type=Path, action="append", default=[])
    ap.add_argument("--pairs", type=int, default=200)
    a = ap.parse_args()
    synthetic(a.pairs)
    collapsing()
    if a.records:
        records()
    for path in a.harness:
        harness(path)


if __name__ == "__main__":
    main()
