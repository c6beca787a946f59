"""The empirical-Fisher quadratic, and why it is refused as D_t.

1/2 dtheta^T F-hat dtheta with F-hat = (1/n) S^T S from n score vectors is a second-order
approximation of KL(pi_{t+1} || pi_t) that is only as good as F-hat along dtheta. With n in
the single digits and |theta| in the millions, F-hat has rank <= n, and when the scores
come from the very rollouts the step was computed on, dtheta lies inside their span: the
quadratic reads the whole step length in the few directions F-hat can see. The seed page
measured 1.3e-2 nats against a true 1.2e-4 (110x) from eight rollouts, and 13,179 against
3.9 at a large step. So this module computes the number for diagnosis
(``empirical_fisher_quadratic``) and refuses to hand it out as ``kl_spent``.
"""

from __future__ import annotations

import numpy as np

from reward_lens_spec import Refusal, Subject, load_book, make_refusal


def empirical_fisher_quadratic(scores: np.ndarray, delta_theta: np.ndarray) -> float:
    """1/2 dtheta^T ((1/n) S^T S) dtheta = 1/(2n) ||S dtheta||^2, without forming F."""
    s = np.asarray(scores, dtype=np.float64)
    d = np.asarray(delta_theta, dtype=np.float64).reshape(-1)
    if s.ndim != 2 or s.shape[1] != d.shape[0]:
        raise ValueError(f"scores {s.shape} and delta_theta {d.shape} disagree on the parameter count")
    proj = s @ d
    return float(0.5 * (proj @ proj) / s.shape[0])


def kl_spent_from_empirical_fisher(scores: np.ndarray, delta_theta: np.ndarray, *,
                                   run_id: str | None = None, step: int | None = None) -> Refusal:
    """Always a refusal (PROXY_REFUSED): the quadratic is computed and shown, never returned as D_t."""
    s = np.asarray(scores)
    value = empirical_fisher_quadratic(s, delta_theta)
    pairs = [(step, step + 1)] if step is not None else []
    return make_refusal("PROXY_REFUSED", load_book("cost"), Subject(run_id=run_id, step_pairs=tuple(pairs)), {
        "proxy": "empirical_fisher", "value": value, "n": int(s.shape[0]), "dims": int(s.shape[1]),
        "run": (run_id[:12] + "...") if run_id else "(no run)",
    })
