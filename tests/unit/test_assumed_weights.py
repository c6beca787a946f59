"""No silent assumptions in imports: a TRL output folder without ``grpo_config.json`` leaves the
importer to assume the reward weights (1 each, GRPOConfig's default). The record says so in its
notes, the report shows the note, and the findings that read the weighted reward say so; those
that do not read it (the selection differential is TRL's own advantage) do not. With the config,
or with a config stating the weights (``reward_weights: null`` is GRPOConfig's default, stated),
nothing is said."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reward_lens import cli
from reward_lens.record.importers.trl_output import ASSUMED_WEIGHTS, assumed_reward_weights, import_trl

BASIS = """
name: gold
features:
  - name: correct
    kind: reward
    reward: correctness
    unit: "indicator (0/1)"
    target: higher
  - name: tagged
    kind: regex
    pattern: "^<a>"
"""


def trl_output(root: Path, steps: int = 10, prompts: int = 4, group: int = 8, config: dict | None = None) -> Path:
    """GRPOTrainer's output shape with two reward functions, `correctness` and `format`, trained
    (as the format-only run is) with weights 0 and 1: the format rises, correctness falls."""
    import pandas as pd

    rng = np.random.default_rng(0)
    (root / "completions").mkdir(parents=True)
    history = []
    for s in range(1, steps + 1):
        rows = []
        for p in range(prompts):
            tagged = rng.random(group) < min(0.95, 0.3 + 0.08 * s)
            right = rng.random(group) < max(0.05, 0.7 - 0.08 * s)
            fmt = tagged.astype(float)
            adv = (fmt - fmt.mean()) / (fmt.std() + 1e-4)  # weights (0, 1): the format alone is paid
            rows += [{"step": s, "prompt": f"Q{s}-{p}", "completion": ("<a>" if t else "") + ("4" if r else "5"),
                      "correctness": float(r), "format": float(f), "advantage": float(a)}
                     for t, r, f, a in zip(tagged, right, fmt, adv)]
        pd.DataFrame(rows).to_parquet(root / "completions" / f"completions_{s:05d}.parquet")
        history.append({"step": s, "loss": 0.1, "grad_norm": 0.5, "learning_rate": 1e-3, "reward": 0.5,
                        "rewards/correctness/mean": 0.5, "rewards/format/mean": 0.5})
    (root / "trainer_state.json").write_text(json.dumps({"log_history": history, "logging_steps": 1}))
    if config is not None:
        (root / "grpo_config.json").write_text(json.dumps(config))
    return root


def test_without_a_config_the_record_notes_the_assumed_weights(tmp_path):
    out = trl_output(tmp_path / "trl")
    m = import_trl(out, tmp_path / "rec")
    note = assumed_reward_weights(m.notes)
    assert note is not None and note.startswith(ASSUMED_WEIGHTS)
    assert "`correctness` 1, `format` 1" in note and "no trainer config" in note
    from reward_lens.record import open_run

    rows = open_run(tmp_path / "rec").read_rollouts(["reward", "rewards"]).to_pylist()
    assert all(r["reward"] == pytest.approx(sum(v for _, v in r["rewards"])) for r in rows)  # what was assumed


@pytest.mark.parametrize("config,said", [
    ({"num_generations": 8, "reward_weights": [0.0, 1.0]}, False),
    ({"num_generations": 8, "reward_weights": None}, False),  # GRPOConfig's default, stated
    ({"num_generations": 8}, True),  # a config that does not say
    ({"num_generations": 8, "reward_weights": [1.0, 1.0, 1.0]}, True),  # says, for three functions: not these
    ({"num_generations": 8, "reward_weights": []}, True),  # says: no weights at all (issue 61 item 11)
])
def test_a_config_that_states_the_weights_is_believed(tmp_path, config, said):
    m = import_trl(trl_output(tmp_path / "trl", config=config), tmp_path / "rec")
    assert (assumed_reward_weights(m.notes) is not None) == said
    if said and config.get("reward_weights") is not None:
        assert "do not match the 2 reward functions" in assumed_reward_weights(m.notes)


def test_check_on_the_folder_says_which_findings_rest_on_the_assumption(tmp_path, capsys):
    out = trl_output(tmp_path / "trl")
    basis = tmp_path / "gold.yaml"
    basis.write_text(BASIS)
    cli.main(["check", str(out), "--features", str(basis), "--format", "json", "--quiet"])
    by = {f["id"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    gaming = by["proxy_gaming"]  # reads each rollout's weighted reward: it rests on the weights
    assert gaming["status"] != "not_evaluated" and "weights were assumed at import" in gaming["evidence"]
    for fid in ("moving_against_reward", "collateral_behaviour", "advantage_collapse"):
        assert "weights were assumed" not in by[fid]["evidence"], fid  # TRL's advantages and logged scalars
    with_config = trl_output(tmp_path / "trl2", config={"num_generations": 8, "reward_weights": [0.0, 1.0]})
    cli.main(["check", str(with_config), "--features", str(basis), "--format", "json", "--quiet"])
    again = {f["id"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert "weights were assumed" not in again["proxy_gaming"]["evidence"]


def test_the_report_shows_the_note(tmp_path):
    from reward_lens.record import open_run
    from reward_lens.report import build_report
    from reward_lens.report import to_markdown

    import_trl(trl_output(tmp_path / "trl"), tmp_path / "rec")
    page = to_markdown(build_report(open_run(tmp_path / "rec")))
    assert "> reward weights assumed: each rollout's" in page and "GRPOConfig's default" in page  # (Markdown-escaped)
