"""Print the README's "what it measures when the denominator exists" table.

Runs ``reward_lens.measure.whitebox.experiment.run_experiment`` on the checkpoint the long
reference record started from, with the record's step-0 rollouts and advantages, at the two
step sizes the acceptance test uses (``tests/acceptance/test_w4_4_whitebox.py``)::

    .venv/bin/python tools/whitebox_experiment.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from reward_lens.measure.whitebox.experiment import run_experiment  # noqa: E402
from reward_lens.measure.whitebox.policy import load_policy  # noqa: E402
from reward_lens.record import open_run  # noqa: E402
from reward_lens.record.reader import Window  # noqa: E402


def main() -> None:
    long = REPO / "tests" / "fixtures" / "grpo_run" / "long"
    run = open_run(long)
    model, tok = load_policy(long / run.manifest.checkpoints[0].path)
    step0 = run.read_rollouts(["prompt", "completion", "advantage"], Window(0, 0)).to_pydict()
    res = run_experiment(model, tok, step0["prompt"][0], step0["completion"], np.array(step0["advantage"]),
                         [100.0, 0.01])
    print("| step size | ‖Δθ‖ | D_t (nats/seq, ± SE) | max \\|t\\| of Δz | KL_min rung 1 (noise floor) | rung 1 | "
          "KL_min rung 2 | rung 2 | ½Δθᵀ F̂ Δθ / D_t: fresh 64 / own 8 rollouts |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res:
        v1 = f"η = {r.eta_rung1:.3f}" if r.eta_rung1 is not None else f"{r.refusal_rung1} (ratio {r.raw_ratio_rung1:.3g})"
        v2 = f"η = {r.eta_rung2:.3f}" if r.eta_rung2 is not None else str(r.refusal_rung2)
        v2 += ", damping stable" if r.rung2_stable else ", damping not stable"
        print(f"| {r.step_size:g} | {r.update_norm:.3g} | {r.d_t:.3g} ± {r.d_t_se:.2g} | {r.max_abs_t:.1f} | "
              f"{r.kl_min_rung1:.3g} ({r.noise_floor_rung1:.3g}) | {v1} | {r.kl_min_rung2:.3g} | {v2} | "
              f"{r.fisher_fresh_ratio:.3g} / {r.fisher_own_ratio:.3g} |")
    print()
    print("rung 2:", res[0].rung2_reading)


if __name__ == "__main__":
    main()
