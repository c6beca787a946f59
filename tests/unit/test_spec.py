"""The declarative layer: specs load with line-numbered errors, fields match the schema,
the resolver finds alternatives and near misses, refusals render from templates."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reward_lens.record import open_run
from reward_lens.record.schema import OptimizerTelemetry, Rollout, arrow_schema
from reward_lens_spec import Presence, SpecError, load_book, load_books, load_fields, load_refusal_codes, resolve
from reward_lens_spec.loader import load_model
from reward_lens_spec.models import BookSpec
from reward_lens_spec.paths import specs_dir
from tests.conftest import LONG

REPO = Path(__file__).resolve().parents[2]


def test_specs_load():
    books = load_books()
    assert "cost" in books
    cost = books["cost"]
    assert (cost.series, cost.section, cost.function) == ("F3", "3.1.4", "cost_series")
    assert cost.envelope["efficiency"].min == 0.0 and cost.envelope["efficiency"].max == 1.0
    alts = [a.id for a in cost.requirement("denominator").alternatives]
    assert alts == ["record_kl", "caller_kl_spent", "paired_token_kl", "paired_token_kl_extra"]
    assert set(load_refusal_codes().codes) >= {"RECORD_INCOMPLETE", "UNIT_MISMATCH", "ENVELOPE_VIOLATED"}


def test_schema_and_fields_yaml_agree():
    fields = load_fields()
    tel = {n for n, f in fields.fields.items() if f.source == "telemetry"}
    assert tel == set(OptimizerTelemetry.model_fields)
    rol = {f.column for f in fields.by_source("rollouts").values()}
    assert rol == set(Rollout.model_fields)
    assert arrow_schema("telemetry").names == [f.column for f in fields.by_source("telemetry").values()]
    for name, spec in fields.fields.items():
        assert spec.unit in fields.units, name


def test_framework_facts_in_fields_yaml():
    f = load_fields().fields
    # transformers logs the return value of clip_grad_norm_: the pre-clip norm.
    assert f["grad_norm_unclipped"].frameworks["trl"].key == "grad_norm"
    assert "trl" not in f["grad_norm"].frameworks or f["grad_norm"].frameworks["trl"].key is None
    # TRL's `kl` is KL to the reference model, per token, and only when beta != 0.
    assert f["kl_to_ref"].frameworks["trl"].key == "kl" and f["kl_to_ref"].unit == "nats_per_token"
    assert f["kl_to_previous"].frameworks["trl"].absent
    # veRL has no `actor/kl`; its ppo_kl is not D_t.
    keys = load_fields().framework_keys("verl")
    assert "actor/kl" not in keys and keys["actor/ppo_kl"] == "ppo_kl"


def test_trl_framework_facts_hold_in_the_installed_sources():
    """The facts above, checked in the installed TRL/transformers rather than remembered."""
    import inspect

    import trl

    from transformers import TrainingArguments, Trainer
    from trl import GRPOConfig

    assert GRPOConfig.__dataclass_fields__["beta"].default == 0.0
    assert TrainingArguments.__dataclass_fields__["optim"].default == "adamw_torch_fused"
    src = inspect.getsource(Trainer._clip_grad_norm)
    assert "Returns the pre-clip gradient norm" in src
    grpo = inspect.getsource(__import__("trl.trainer.grpo_trainer", fromlist=["x"]))
    assert 'if self.beta != 0.0:\n            self._metrics[mode]["kl"]' in grpo
    assert "torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1" in grpo
    assert trl.__version__


def _spec_copy(tmp_path) -> Path:
    root = tmp_path / "specs"
    shutil.copytree(specs_dir(), root)
    return root


def test_malformed_spec_names_file_and_line(tmp_path):
    root = _spec_copy(tmp_path)
    path = root / "books" / "cost.yaml"
    lines = path.read_text().splitlines()
    n = next(i for i, l in enumerate(lines) if l.strip().startswith("series:"))
    lines[n] = "series: [not, a, string]"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError) as exc:
        load_model(path, BookSpec)
    assert str(exc.value).startswith(f"{path}:{n + 1}: series:")


def test_invalid_yaml_names_file_and_line(tmp_path):
    root = _spec_copy(tmp_path)
    path = root / "books" / "cost.yaml"
    text = path.read_text().splitlines()
    text.insert(5, "  bad: [unclosed")
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(SpecError, match=rf"{path}:\d+: invalid YAML"):
        load_book("cost", root)


def test_spec_naming_an_unknown_field_is_refused(tmp_path):
    root = _spec_copy(tmp_path)
    path = root / "books" / "cost.yaml"
    path.write_text(path.read_text().replace("fields: [kl_to_previous]", "fields: [kl_to_previus]"))
    with pytest.raises(SpecError, match="unknown field `kl_to_previus`"):
        load_book("cost", root)


def test_resolver_on_the_reference_record():
    run = open_run(LONG)
    res = resolve(load_book("cost"), run.fields(), optimizer=run.manifest.optimizer)
    assert res.status("rollouts").satisfied_by == "record_rollouts"
    den = res.status("denominator")
    assert den.satisfied_by is None and not res.computable
    assert {a.id: a.missing for a in den.alternatives} == {"record_kl": ("kl_to_previous",),
                                                           "caller_kl_spent": ("kl_spent",),
                                                           "paired_token_kl": ("rollout.kl_prev", "rollout.logp_prev"),
                                                           "paired_token_kl_extra": ("heldout",)}
    present = {nm.spec.field: nm for nm in den.near_misses if nm.present}
    assert set(present) == {"grad_norm_unclipped", "checkpoints"}
    assert present["checkpoints"].presence.count == 1  # only the starting checkpoint: no pair
    # It helps only for plain SGD, and this run used AdamW.
    assert present["grad_norm_unclipped"].applies is False


def test_resolver_with_caller_supplied_denominator_and_partial_presence():
    book = load_book("cost")
    base = {"rollout.step": Presence(10, 10), "rollout.completion": Presence(10, 10)}
    assert resolve(book, {**base, "kl_spent": Presence(10, 10)}).status("denominator").satisfied_by == "caller_kl_spent"
    partial = resolve(book, {**base, "kl_to_previous": Presence(4, 10)}).status("denominator")
    assert partial.satisfied_by is None and partial.partially_by == "record_kl"


def test_no_remedy_prose_in_python():
    """Remedies live in templates/: a distinctive sentence of each is in no .py file."""
    phrases = ["No mainstream trainer logs it", "Resolve the movement before pricing it",
               "Nothing is re-ordered silently"]
    for py in list((REPO / "reward_lens").rglob("*.py")) + list((REPO / "reward_lens_spec").rglob("*.py")):
        text = py.read_text()
        for phrase in phrases:
            assert phrase not in text, f"{py} contains remedy prose {phrase!r}"
    templates = "".join(p.read_text() for p in (REPO / "templates").rglob("*.j2"))
    for phrase in phrases:
        assert phrase in templates
