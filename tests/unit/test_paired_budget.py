"""The paired ledger on a record written under a cost budget (docs: SCOPES' "record contract under
a budget"): a tap that scores only a uniformly random subset of each step's prompt groups leaves
``logp_prev``, ``kl_prev``, ``logp_prev_step`` (and possibly ``logp_pre``) null on every rollout
of the others, and writes held-out rows for scored groups only. The ledger prices the step on the
scored groups alone; checked here against the ledger of a record that holds only those groups:
the same numbers bit for bit, and standard errors that add the sampling of the scored groups from
the step's (two-stage sampling, worked out by hand here); the contract's violations are refused by
name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from reward_lens.measure.efficiency.eta import paired_estimates
from reward_lens.measure.ledger.paired import NotFormed, paired_ledger, paired_ledger_series
from reward_lens.measure.ledger.price import StepSample, _samples

TAPPED = Path(__file__).parents[1] / "fixtures" / "grpo_run" / "tapped"

# what a ledger holds that a budget must not change, compared with ==
FIELDS = ("delta_z", "se", "cov_delta", "d_hat", "d_t", "d_t_se", "pareto_k", "ess", "log_ratio", "z", "codes",
          "n_groups", "kl", "heldout", "dropped_rollouts", "step_pair", "n_pre")


def _same(a, b, fields=FIELDS) -> None:
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None and x.shape == y.shape, f
            assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), f
        elif isinstance(x, float) and x != x:
            assert y != y, f
        else:
            assert x == y, f


# what the sampling of the scored groups from the step's changes: the standard errors
SAMPLED = ("se", "cov_delta", "d_t_se")


def _by_hand(lg):
    """Each prompt group's dz_g and D_t's term, written out from the ledger's rows (the balance
    heuristic in a loop over groups: q prop. to 1 / (n_a e^-r + n_b), p to 1 / (n_a + n_b e^r))."""
    dz, d = [], []
    side = lg.heldout if lg.heldout is not None else np.zeros(len(lg.codes), dtype=bool)
    for g in range(lg.n_groups):
        rows = lg.codes == g
        r, a = lg.log_ratio[rows], side[rows]
        n_a, n_b = int(a.sum()), int((~a).sum())
        q = 1.0 / (n_a * np.exp(-r) + n_b)
        p = 1.0 / (n_a + n_b * np.exp(r))
        q, p = q / q.sum(), p / p.sum()
        dz.append(q @ lg.z[rows] - p @ lg.z[rows])
        d.append(q @ lg.kl[rows])
    # a behaviour equal on every row of each group moved by exactly 0 (the ledger's rule; the sums
    # above leave ~1e-16 of rounding)
    same = np.all([(lg.z[lg.codes == g] == lg.z[lg.codes == g][:1]).all(axis=0) for g in range(lg.n_groups)], axis=0)
    dz = np.array(dz)
    dz[:, same] = 0.0
    return dz, np.array(d)


def _same_but_groups_sampled(lg, alone, n_step: int) -> None:
    """``lg`` (n of the step's ``n_step`` groups scored) holds the numbers of ``alone`` (a record of
    those n groups only), and its SEs add the sampling of the n groups from the n_step (two-stage:
    (1 - f) s_b^2 / n + f Var_within, f = n / n_step, s_b^2 the spread of the groups' own values
    worked out by hand here, Var_within the alone ledger's)."""
    _same(lg, alone, tuple(f for f in FIELDS if f not in SAMPLED))
    dz_g, d_g = _by_hand(alone)
    n = alone.n_groups
    f = n / n_step
    assert np.allclose(dz_g.mean(axis=0), lg.delta_z, rtol=1e-10, atol=1e-13)
    cov = (1 - f) * np.cov(dz_g, rowvar=False, ddof=1) / n + f * alone.cov_delta
    assert np.allclose(lg.cov_delta, cov, rtol=1e-10, atol=1e-18)
    assert np.allclose(lg.se, np.sqrt(np.diag(cov)), rtol=1e-10)
    moved = alone.se > 0  # a behaviour constant in every group moved by exactly 0: no SE either way
    assert not moved.any() or not np.array_equal(lg.se[moved], alone.se[moved])
    assert np.isclose(lg.d_t_se ** 2, (1 - f) * d_g.var(ddof=1) / n + f * alone.d_t_se ** 2, rtol=1e-10)


def _step(step, rng, n_groups=8, m=6, h=0):
    """A fully scored step of ``n_groups`` x ``m`` rollouts (TRL's layout), and ``h`` held-out
    completions of pi_t per group (None with h = 0)."""
    codes = np.repeat(np.arange(n_groups), m)
    z = rng.normal(size=(len(codes), 3))
    lp0 = -4.0 + 0.5 * rng.normal(size=len(codes))
    r = 0.3 * z[:, 0] + 0.2 * rng.normal(size=len(codes))
    s = StepSample(step, ("a", "b", "c"), z, groups=codes, logp=lp0 + r, logp_prev=lp0,
                   kl_prev=0.5 * r ** 2 + 1e-3, logp_prev_step=np.full(len(codes), step - 1.0), n_groups=n_groups)
    if not h:
        return s, None
    hc = np.repeat(np.arange(n_groups), h)
    zh = rng.normal(size=(len(hc), 3))
    l0 = -4.0 + 0.5 * rng.normal(size=len(hc))
    rh = 0.3 * zh[:, 0] + 0.2 * rng.normal(size=len(hc))
    ho = StepSample(step, s.names, zh, groups=hc, logp=l0 + rh, logp_prev=l0, kl_prev=0.5 * rh ** 2 + 1e-3,
                    logp_prev_step=np.full(len(hc), step - 1.0), n_groups=n_groups)
    return s, ho


def _budget(s: StepSample, scored: np.ndarray, null_logp: bool = False) -> StepSample:
    """``s`` as a tap under a budget writes it: the columns of the scoring under pi_{t-1} null
    (NaN) on every rollout of an unscored group; ``null_logp``: logp_pre too."""
    off = ~scored[s.groups]

    def blank(a):
        a = np.asarray(a, dtype=np.float64).copy()
        a[off] = np.nan
        return a
    return StepSample(s.step, s.names, s.z, groups=s.groups, logp=blank(s.logp) if null_logp else s.logp,
                      logp_prev=blank(s.logp_prev), kl_prev=blank(s.kl_prev), logp_prev_step=blank(s.logp_prev_step),
                      n_groups=s.n_groups)


def _only(s: StepSample | None, groups: np.ndarray) -> StepSample | None:
    """The rows of ``s`` in ``groups`` alone, coded 0.. in the order of ``groups`` (the order of
    first appearance in the step's rollouts): the record a tap would have written had the step
    had only those prompts."""
    if s is None:
        return None
    keep = np.isin(s.groups, groups)
    new = {g: i for i, g in enumerate(np.asarray(groups).tolist())}
    codes = np.array([new[g] for g in s.groups[keep].tolist()], dtype=np.int64)
    return StepSample(s.step, s.names, s.z[keep].copy(), groups=codes, logp=s.logp[keep].copy(),
                      logp_prev=s.logp_prev[keep].copy(), kl_prev=s.kl_prev[keep].copy(),
                      logp_prev_step=s.logp_prev_step[keep].copy(), n_groups=len(set(codes.tolist())))


@pytest.mark.parametrize("h", [0, 2])
@pytest.mark.parametrize("null_logp", [False, True])
def test_half_the_groups_unscored_prices_as_the_scored_groups_alone_with_their_sampling_added(h, null_logp):
    rng = np.random.default_rng(7 + h)
    s, ho = _step(5, rng, h=h)
    scored = np.zeros(8, dtype=bool)
    scored[rng.choice(8, 4, replace=False)] = True
    held = None if ho is None else _only(ho, np.flatnonzero(scored))  # held-out rows of scored groups only
    if held is not None:  # coded as the step's groups (a read codes both sides at once)
        held = StepSample(held.step, held.names, held.z, groups=ho.groups[np.isin(ho.groups, np.flatnonzero(scored))],
                          logp=held.logp, logp_prev=held.logp_prev, kl_prev=held.kl_prev,
                          logp_prev_step=held.logp_prev_step)
    lg = paired_ledger(_budget(s, scored, null_logp), heldout=held)
    want = paired_ledger(_only(s, np.flatnonzero(scored)), heldout=_only(ho, np.flatnonzero(scored)))
    _same_but_groups_sampled(lg, want, 8)
    assert lg.sides == ("two-sided" if h else "one-sided")
    assert (lg.n_groups, lg.groups_in_step, lg.groups_unscored) == (4, 8, 4)
    assert (want.n_groups, want.groups_in_step, want.groups_unscored) == (4, 4, 0)
    # eta on them: the same I-projection, jackknife and D_t
    a, b = paired_estimates([(lg, np.arange(3)), (want, np.arange(3))])
    assert (a.kl_min, a.kl_min_debiased, a.d_t, a.p_value) == (b.kl_min, b.kl_min_debiased, b.d_t, b.p_value)
    assert np.array_equal(a.cov, b.cov)


def test_a_series_read_from_one_stack_prices_budgeted_steps_as_their_scored_groups_alone():
    """Steps as the report's one read holds them (views of one stack), each with its own random
    subset of scored groups (some none, one every group), held-out rows for a subset of the
    scored groups: every ledger holds the numbers of its scored groups alone, bit for bit, its SEs
    with their sampling added (one step has every group scored: equal, SEs too); the step
    with no scored group is ``no_logp_prev``, the one with one scored group ``few_groups``."""
    rng = np.random.default_rng(11)
    steps, held, alone, alone_ho, subsets = [], {}, [], {}, {}
    for t in range(1, 9):
        s, ho = _step(t, rng, h=2)
        k = {3: 0, 4: 1, 6: 8}.get(t, 5)
        scored = np.zeros(8, dtype=bool)
        scored[rng.choice(8, k, replace=False)] = True
        with_ho = scored & (rng.random(8) < 0.7)  # held-out rows for some scored groups only
        subsets[t] = np.flatnonzero(scored)
        steps.append(_budget(s, scored))
        keep = with_ho[ho.groups]
        held[t] = StepSample(t, s.names, ho.z[keep], groups=ho.groups[keep], logp=ho.logp[keep],
                             logp_prev=ho.logp_prev[keep], kl_prev=ho.kl_prev[keep],
                             logp_prev_step=ho.logp_prev_step[keep], n_groups=8)
        alone.append(_only(s, subsets[t]))
        alone_ho[t] = _only(held[t], subsets[t]) if keep.any() else None
    # the steps as one read's stack: rows of every step in one array per column
    cols = {"group_id": np.concatenate([s.groups for s in steps]),
            **{c: np.concatenate([getattr(s, a) for s in steps])
               for c, a in (("logp_pre", "logp"), ("logp_prev", "logp_prev"), ("kl_prev", "kl_prev"),
                            ("logp_prev_step", "logp_prev_step"))}}
    read = _samples(np.repeat(np.arange(1, 9), 48), np.vstack([s.z for s in steps]), cols,
                    {"logp_prev", "kl_prev", "logp_prev_step"}, steps[0].names, coded=True)
    assert read[0].stack is not None and read[2].logp_prev is None  # step 3: no group scored, the column absent
    ledgers, why = paired_ledger_series(read, {t: 0.1 for t in range(9)}, held)
    assert why == {(2, 3): NotFormed("no_logp_prev", 3), (3, 4): NotFormed("few_groups", 4, 1)}
    assert [lg.step_pair[1] for lg in ledgers] == [1, 2, 5, 6, 7, 8]
    for lg in ledgers:
        t = lg.step_pair[1]
        want = paired_ledger(alone[t - 1], heldout=alone_ho[t])
        if len(subsets[t]) == 8:  # every group scored: the ledger of the record itself, bit for bit
            _same(lg, want)
        else:
            _same_but_groups_sampled(lg, want, 8)
        assert (lg.n_groups, lg.groups_in_step, lg.groups_unscored) == (len(subsets[t]), 8, 8 - len(subsets[t]))


def test_a_group_scored_on_some_rows_only_is_refused_by_name():
    rng = np.random.default_rng(3)
    s, ho = _step(4, rng, h=2)
    scored = np.array([True, True, False, True, False, True, True, False])
    b = _budget(s, scored)
    lp = b.logp_prev.copy()
    lp[np.flatnonzero(b.groups == 0)[2]] = np.nan  # group 0: one rollout unscored
    lp[np.flatnonzero(b.groups == 2)[0]] = -3.0  # group 2 (unscored): one rollout scored
    part = StepSample(4, b.names, b.z, groups=b.groups, logp=b.logp, logp_prev=lp, kl_prev=b.kl_prev,
                      logp_prev_step=b.logp_prev_step, n_groups=8)
    assert paired_ledger(part) == NotFormed("partly_scored_group", 4, 2)
    ledgers, why = paired_ledger_series([_step(3, rng)[0], part])
    assert [lg.step_pair for lg in ledgers] == [(2, 3)] and why == {(3, 4): NotFormed("partly_scored_group", 4, 2)}
    # held-out rows of a group whose rollouts were not scored: neither scored whole nor left out
    assert paired_ledger(b, heldout=ho) == NotFormed("partly_scored_group", 4, 3)
    # the refusal's words name it
    from reward_lens.measure.decisions import REASONS

    assert "some rollouts only" in REASONS["partly_scored_group"]


def test_a_budgeted_record_read_from_disk_prices_as_the_record_of_its_scored_groups(tmp_path):
    """The tapped fixture rewritten as a tap under a budget writes it (half the groups of every
    step unscored, their held-out rows absent), and again holding only the scored groups' rows:
    ``steps_from_run`` and the paired ledgers of the two records agree bit for bit (the SEs with the
    sampling of the 16 groups from the 32 added), and the cost
    book's rows say on how many groups of how many D_t was measured."""
    from reward_lens.measure.efficiency.of_run import price_run
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.price import steps_from_run
    from reward_lens.record.reader import open_run
    from reward_lens.record.schema import RunManifest, content_run_id
    from reward_lens.record.writer import sha256_file

    rng = np.random.default_rng(5)
    chosen: dict[int, set] = {}

    def scored_of(table: pa.Table) -> np.ndarray:
        steps, groups = table.column("step").to_pylist(), table.column("group_id").to_pylist()
        for t in sorted(set(steps)):
            if t not in chosen:
                labels = sorted({g for st, g in zip(steps, groups) if st == t})
                chosen[t] = set(rng.choice(labels, len(labels) // 2, replace=False).tolist())
        return np.array([g in chosen[st] for st, g in zip(steps, groups)])

    budget, alone = tmp_path / "budget", tmp_path / "alone"
    for root in (budget, alone):
        shutil.copytree(TAPPED, root)
    manifests = {root: json.loads((root / "manifest.json").read_text()) for root in (budget, alone)}
    for name in sorted(p.name for p in TAPPED.glob("*.parquet") if not p.name.startswith("telemetry")):
        table = pq.read_table(TAPPED / name)
        keep = scored_of(table)
        keep[np.asarray(table.column("step").to_pylist()) == 0] = True  # step 0: nothing to score under
        if name.startswith("rollouts"):
            cut = table
            for c in ("logp_prev", "kl_prev", "logp_prev_step"):
                i = cut.schema.get_field_index(c)
                cut = cut.set_column(i, cut.schema.field(i), pc.if_else(pa.array(keep), cut.column(c),
                                                                         pa.nulls(len(keep), cut.column(c).type)))
        else:
            cut = table.filter(pa.array(keep))
        pq.write_table(cut, budget / name)
        pq.write_table(table.filter(pa.array(keep)), alone / name)
        for root in (budget, alone):
            manifests[root]["files"][name] = {"sha256": sha256_file(root / name), "bytes": (root / name).stat().st_size,
                                              "rows": pq.read_metadata(root / name).num_rows}
    for root, m in manifests.items():
        manifest = RunManifest.model_validate(m)
        manifest = manifest.model_copy(update={"run_id": content_run_id(manifest)})  # the id names the new content
        (root / "manifest.json").write_text(manifest.model_dump_json(indent=2))
    priced = {}
    for root in (budget, alone):
        run = open_run(root)
        priced[root] = price_run(run, steps_from_run(run, SurfaceFeatures()), ledger="auto")
    a, b = priced[budget], priced[alone]
    assert a.ledger == b.ledger == "paired" and not a.not_formed and not b.not_formed
    assert len(a.ledgers) == len(b.ledgers) == 29
    for x, y in zip(a.ledgers, b.ledgers):
        _same_but_groups_sampled(x, y, 32)
        assert x.sides == "two-sided" and x.n_groups == 16 and x.groups_in_step == 32 and x.groups_unscored == 16
    ra, rb = a.book.rows, b.book.rows
    assert [r.efficiency_debiased for r in ra] == [r.efficiency_debiased for r in rb]
    assert all("on the 16 of 32 prompt groups the tap scored" in r.kl_spent_source for r in ra)
    assert not any("prompt groups the tap scored" in r.kl_spent_source for r in rb)


def test_the_refusal_of_a_partly_scored_group_says_what_the_tap_must_write():
    from reward_lens_spec import Subject, load_book, make_refusal

    r = make_refusal("RECORD_INCOMPLETE", load_book("cost"), Subject(run_id="run:x", step_pairs=((3, 4),)),
                     {"requirement": "ledger", "ledger": "paired", "run": "x", "n_pairs": 1, "pairs_shown": "3->4",
                      "reason": "partly_scored_group", "steps": [{"step": 4, "count": 2}], "framework": "trl"})
    assert "step 4 has 2 groups scored on some rows only" in r.detail
    assert "on every rollout of a group it scored and on none of a group it did not" in r.remedy
