"""The paired ledger's standard errors of dz and D_t against their real spread, conditional on
the prompts: a known model (prompts whose completions are two tokens, both policies written out,
every truth exact by enumeration) sampled as the tap samples it, the prompts fixed, many times
over -- in the extra-completion design (k completions of each policy per prompt) and with 8 of
pi_{t+1} and 4 of pi_t; a moderate step and a peaked policy, where the between-prompt SE these
replaced was several times too wide (issue 41; the truth harness measures the same on real runs:
docs/science.md)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import optimize
from scipy.special import logsumexp, softmax

from reward_lens.measure.efficiency.eta import paired_estimates
from reward_lens.measure.ledger.paired import paired_ledger
from reward_lens.measure.ledger.price import StepSample


def _model(rng, g=8, v1=6, v2=5, step=0.3, sharp=1.0):
    """Per prompt: completions (a, b) of two tokens, pi_t and pi_{t+1} as two softmax layers, the
    step a random shift of their logits plus a push towards larger a. Per completion: log pi_t,
    log pi_{t+1}, the token KL(pi_{t+1} || pi_t) summed along its prefixes (first token's, then
    the second token's given a), and three features."""
    out = []
    a_, b_ = np.meshgrid(np.arange(v1), np.arange(v2), indexing="ij")
    z = np.stack([a_ / v1, (b_ == 0), (a_ * b_) % 3 == 0], axis=-1).astype(float).reshape(-1, 3)
    for _ in range(g):
        th, ph = rng.normal(size=v1) * sharp, rng.normal(size=(v1, v2)) * sharp
        dth, dph = step * rng.normal(size=v1) + 2 * step * np.arange(v1) / v1, step * rng.normal(size=(v1, v2))
        a0, a1 = softmax(th), softmax(th + dth)
        b0, b1 = softmax(ph, axis=1), softmax(ph + dph, axis=1)
        kl = np.sum(a1 * np.log(a1 / a0)) + np.sum(b1 * np.log(b1 / b0), axis=1)[:, None] * np.ones((1, v2))
        out.append({"lp0": (np.log(a0)[:, None] + np.log(b0)).ravel(), "lp1": (np.log(a1)[:, None] + np.log(b1)).ravel(),
                    "kl": kl.ravel(), "z": z})
    return out


def _truth(model):
    """dz, D_t and KL_min of the model, by enumeration (KL_min: the pooled I-projection, by BFGS)."""
    mu1 = [np.exp(m["lp1"]) @ m["z"] for m in model]
    dz = np.mean([mu - np.exp(m["lp0"]) @ m["z"] for mu, m in zip(mu1, model)], axis=0)
    d_t = np.mean([np.exp(m["lp1"]) @ m["kl"] for m in model])

    def f(lam):
        return -np.mean([lam @ mu - logsumexp(m["lp0"] + m["z"] @ lam) for mu, m in zip(mu1, model)])

    kl_min = -optimize.minimize(f, np.zeros(3), method="BFGS", options={"gtol": 1e-12}).fun
    return dz, d_t, kl_min


def _draw(model, rng, step, m=8, h=4):
    """The tap's sample of the model: m rollouts of pi_{t+1} and h held-out completions of pi_t per prompt."""
    sides = []
    for lp_key, n in (("lp1", m), ("lp0", h)):
        picks = [(g, rng.choice(len(md[lp_key]), n, p=np.exp(md[lp_key]))) for g, md in enumerate(model)]
        codes = np.concatenate([np.full(n, g) for g, _ in picks])
        rows = [(model[g], i) for g, idx in picks for i in idx]
        sides.append(StepSample(step, ("a", "b0", "ab3"), np.array([md["z"][i] for md, i in rows]), groups=codes,
                                logp=np.array([md["lp1"][i] for md, i in rows]),
                                logp_prev=np.array([md["lp0"][i] for md, i in rows]),
                                kl_prev=np.array([md["kl"][i] for md, i in rows]), n_groups=len(model)))
    return sides




@pytest.mark.parametrize("sharp", [1.0, 3.0])
@pytest.mark.parametrize("m,h", [(4, 4), (8, 4)])
def test_standard_errors_match_the_real_spread_of_the_estimates_for_these_prompts(sharp, m, h):
    """Redrawn 300 times for fixed prompts: the real SD of dz and D_t over the draws against the
    root mean square of the SEs the ledger reports, within [0.85, 1.18]; D_t unbiased; dz and
    KL_min against their exact truths, their measured bias a bound."""
    rng = np.random.default_rng(11)
    model = _model(rng, sharp=sharp)
    dz_true, d_true, kl_true = _truth(model)
    ledgers = [paired_ledger(*_draw(model, rng, 1, m=m, h=h)) for _ in range(300)]
    dz = np.stack([lg.delta_z for lg in ledgers])
    se = np.stack([lg.se for lg in ledgers])
    d = np.array([lg.d_t for lg in ledgers])
    d_se = np.array([lg.d_t_se for lg in ledgers])
    ratio_dz = dz.std(axis=0, ddof=1) / np.sqrt((se ** 2).mean(axis=0))
    ratio_d = d.std(ddof=1) / np.sqrt((d_se ** 2).mean())
    assert ((0.85 <= ratio_dz) & (ratio_dz <= 1.18)).all(), ratio_dz
    assert 0.85 <= ratio_d <= 1.18, ratio_d
    assert abs(d.mean() - d_true) <= 3 * d.std(ddof=1) / np.sqrt(len(d))  # D_t is unbiased
    # dz and KL_min against the truths computed by enumeration above. dz is a ratio of
    # self-normalised weighted means, biased at O(1/n): measured over these 300 draws its mean
    # misses the truth by up to 0.71 of its SD (4 + 4 completions, sharp 1; 0.52 sharp 3, 0.38 and
    # 0.21 at 8 + 4; 0.1 at 32 + 32), a bound a larger bias fails
    bias_dz = np.abs(dz.mean(axis=0) - dz_true) / dz.std(axis=0, ddof=1)
    assert (bias_dz <= 0.8).all(), bias_dz
    # KL_min (eta's numerator, every feature priced): the plug-in lies above the truth by the noise
    # it fits and the group jackknife's correction overshoots below it (measured over these draws,
    # in each one's own SD: plug-in +0.31 to +0.44, corrected -0.42 to -0.63); both a bound, so a
    # correction that lost its sign or its factor fails
    est = paired_estimates([(lg, np.arange(3)) for lg in ledgers])
    plug = np.array([e.kl_min for e in est])
    jk = np.array([e.kl_min_debiased for e in est])
    assert plug.mean() > kl_true > jk.mean(), (plug.mean(), kl_true, jk.mean())
    assert (plug.mean() - kl_true) / plug.std(ddof=1) <= 0.7, (plug.mean(), kl_true)
    assert (kl_true - jk.mean()) / jk.std(ddof=1) <= 0.75, (jk.mean(), kl_true)
