"""`reward-lens audit`: known verdicts per book, the key named as the cause, and no number
in its text that the config does not give or imply."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reward_lens.audit import AuditOut, audit, json_schema
from reward_lens.cli import audit_text
from tests.conftest import LONG

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
FIX = REPO / "tests" / "fixtures"
PAIRED = FIX / "grpo_run" / "paired"
CLI = [str(Path(sys.executable).with_name("reward-lens"))]

TRL_DEFAULTS = {"output_dir": "out", "learning_rate": 1e-6}
PER_STEP = {"num_generations": 8, "logging_steps": 1, "log_completions": True, "max_steps": 437}
VERL = {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"rollout": {"n": 5}},
        "trainer": {"total_training_steps": 213}}
VERL_DUMPS = {**VERL, "trainer": {**VERL["trainer"], "rollout_data_dir": "/data/rollouts"}}

# (name, config, options, verdict, ledger, {requirement: key named as the cause}, ledger cause key)
ROWS = [
    ("trl defaults", TRL_DEFAULTS, {"framework": "trl"}, "will refuse", None,
     {"rollouts": "log_completions", "denominator": "reward_lens"}, None),
    ("beta > 0", {**PER_STEP, "beta": 0.04}, {}, "will refuse", "unpaired", {"denominator": "reward_lens"},
     "reward_lens"),
    ("logging_steps > 1", {**PER_STEP, "logging_steps": 7}, {}, "will refuse", None,
     {"rollouts": "logging_steps", "denominator": "reward_lens"}, None),
    ("log_completions false", {**PER_STEP, "log_completions": False}, {}, "will refuse", None,
     {"rollouts": "log_completions", "denominator": "reward_lens"}, None),
    ("num_generations 1", {**PER_STEP, "num_generations": 1}, {}, "will not run", None, {}, None),
    # TRL's defaults generate 8 completions per process at a time, 8 per prompt: one prompt group, and
    # the paired ledger needs two (the report then reads the run with the unpaired one, as here)
    ("trl defaults with the tap", TRL_DEFAULTS, {"framework": "trl", "with_tap": True}, "will compute", "unpaired",
     {}, "per_device_train_batch_size"),
    ("tap from a config section", {**TRL_DEFAULTS, "num_generations": 4, "reward_lens": {"flush_every": 25}},
     {"framework": "trl"}, "will compute", "paired", {}, None),
    ("tap without an estimator", {**PER_STEP, "reward_lens": {"estimator": None}}, {}, "will refuse", "unpaired",
     {"denominator": "reward_lens.estimator"}, "reward_lens.estimator"),
    ("tap unpaired", {**PER_STEP, "reward_lens": {"paired": False, "estimator": "exact"}}, {}, "will compute",
     "unpaired", {},
     "reward_lens.paired"),
    ("veRL without dumps", VERL, {}, "will refuse", None,
     {"rollouts": "trainer.rollout_data_dir", "denominator": None}, None),
    ("veRL with dumps", VERL_DUMPS, {}, "will refuse", "unpaired", {"denominator": None}, None),
]


def _write(tmp_path: Path, cfg: dict, suffix: str = ".json") -> Path:
    p = tmp_path / f"config{suffix}"
    p.write_text(json.dumps(cfg))
    return p


def _cost(result: AuditOut):
    (b,) = [b for b in result.books if b.book == "cost"]
    return b


@pytest.mark.parametrize("name,cfg,opts,verdict,ledger,causes,ledger_cause", ROWS, ids=[r[0] for r in ROWS])
def test_verdict_and_cause_table(tmp_path, name, cfg, opts, verdict, ledger, causes, ledger_cause):
    res = audit(_write(tmp_path, cfg), **opts)
    b = _cost(res)
    assert b.verdict == verdict
    assert b.ledger == ledger
    assert {r.requirement: r.cause.key for r in b.refusals} == causes
    assert (b.ledger_cause.key if b.ledger_cause else None) == ledger_cause
    if verdict == "will not run":
        assert b.cause.key == "num_generations" and b.cause.value == 1
    # Every refusal's cause names a value the config gives, a default it says is a default,
    # or the fact that the key is unset.
    for r in b.refusals:
        assert r.cause.origin in ("config", "default", "unset", "tap default")
        assert r.cause.says in r.detail  # the detail states the cause in words


@pytest.mark.parametrize("key,value", [("fsdp", "full_shard auto_wrap"), ("fsdp", ["full_shard"]),
                                       ("deepspeed", "ds_zero3.json"), ("deepspeed", {"zero_optimization": {"stage": 2}})])
def test_the_tap_refuses_sharded_training_before_it_starts(tmp_path, key, value):
    cfg = {**PER_STEP, key: value}
    res = audit(_write(tmp_path, cfg), with_tap=True)
    assert {b.verdict for b in res.books} == {"will not run"}
    b = _cost(res)
    assert b.cause.key == key and b.cause.value == value and b.cause.origin == "config"
    assert "RewardLensTap.attach raises" in b.cause.says and "DDP" in b.cause.says
    text = audit_text(res)
    assert "the run will not start: RewardLensTap.attach raises" in text and f"`{key}`" in text
    # without the tap the same config is audited for what TRL's own logs support
    assert _cost(audit(_write(tmp_path, cfg))).verdict == "will refuse"
    # an empty setting is off in transformers, and so here
    assert _cost(audit(_write(tmp_path, {**PER_STEP, key: type(value)()}), with_tap=True)).verdict == "will compute"


def test_the_sharding_keys_the_tap_spec_names_are_training_arguments():
    import dataclasses

    from trl import GRPOConfig as TrainingArguments  # TRL's config: transformers' arguments and its own

    from reward_lens_spec import load_taps

    def first_key(when):  # a list of conditions names its key first
        return (when[0] if isinstance(when, list) else when).key

    def keys_of(when):
        return {c.key for c in (when if isinstance(when, list) else [when] if when else [])}

    spec = load_taps()["trl"]
    assert {first_key(r.when) for r in spec.rejects} == {"fsdp", "deepspeed"}
    # every key a reject or a setting's condition reads (use_cpu too) is one TRL really has
    keys = set().union(*(keys_of(r.when) for r in spec.rejects), *(keys_of(s.when) for s in spec.settings),
                       *(keys_of(s.when) for s in spec.supplies))
    keys = {k.split(".")[0] for k in keys if not k.startswith("reward_lens.")}  # the tap's own section aside
    assert {"fsdp", "deepspeed", "use_cpu", "fsdp_config", "use_vllm"} <= keys
    assert keys <= {f.name for f in dataclasses.fields(TrainingArguments)}


def test_record_directory_is_audited_as_a_record():
    res = audit(PAIRED)
    assert res.kind == "record" and res.with_tap
    b = _cost(res)
    assert b.verdict == "will compute" and b.ledger == "paired"
    res = audit(LONG)  # no D_t in this record: the cause is the record's missing field
    b = _cost(res)
    assert b.verdict == "will refuse"
    (r,) = b.refusals
    assert r.requirement == "denominator" and r.cause.key == "kl_to_previous" and r.cause.origin == "record"
    assert "this record" in res.subject and "configuration" not in r.detail
    assert audit(LONG / "manifest.json").model_dump() == res.model_dump() | {"source": str(LONG)}


def test_words_say_whether_it_is_a_configuration_or_a_record(tmp_path):
    cfg = audit(_write(tmp_path, PER_STEP))
    assert all("record" not in r.detail.split(":")[0] for r in _cost(cfg).refusals)
    assert "a run logged with this configuration" in _cost(cfg).refusals[0].detail
    tap = audit(_write(tmp_path, {**PER_STEP, "reward_lens": {"estimator": None}}))
    assert "a run recorded by the reward-lens tap with this configuration" in _cost(tap).refusals[0].detail


def test_max_steps_unset_invents_no_count(tmp_path):
    res = audit(_write(tmp_path, {**PER_STEP, "max_steps": -1, "logging_steps": 10}))
    text = audit_text(res, verbose=True)
    assert "`max_steps` is not set" in text
    assert "1000" not in text and " of 1000" not in text
    assert res.fields["rollout.completion"].steps_total is None
    assert res.fields["rollout.completion"].cadence == "one step in 10"
    res = audit(_write(tmp_path, {**PER_STEP, "logging_steps": 10}))
    assert res.fields["rollout.completion"].cadence == "one step in 10 (44 of 437)"


def test_log_completions_false_is_named_not_logging_steps(tmp_path):
    res = audit(_write(tmp_path, {**PER_STEP, "log_completions": False, "logging_steps": 10}))
    (r,) = [r for r in _cost(res).refusals if r.requirement == "rollouts"]
    assert r.cause.key == "log_completions" and "logging_steps" not in r.detail
    assert any("no rollouts at all" in s.says for s in res.statements)


def _numbers(text: str) -> set[float]:
    text = re.sub(r"`[^`]*`", " ", text)  # identifiers and formulas in code spans are not quantities
    return {float(m) for m in re.findall(r"(?<![\w.{}+\-/])\d+(?:\.\d+)?(?:e-?\d+)?(?![\w{}])", text)}


def _config_numbers(obj) -> set[float]:
    out: set[float] = set()
    if isinstance(obj, dict):
        for v in obj.values():
            out |= _config_numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            out |= _config_numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out.add(float(obj))
    return out


@pytest.mark.parametrize("name,cfg,opts", [(r[0], r[1], r[2]) for r in ROWS], ids=[r[0] for r in ROWS])
def test_no_number_that_the_config_does_not_give(tmp_path, name, cfg, opts):
    from reward_lens_spec import load_frameworks, load_taps

    res = audit(_write(tmp_path, cfg), **opts)
    allowed = _config_numbers(cfg)
    # defaults the text names as defaults, and what follows from the config: the logging window
    # and the number of logging steps in the run
    for spec in list(load_frameworks().values()) + list(load_taps().values()):
        allowed |= _config_numbers(spec.defaults)
    steps = cfg.get("max_steps")
    window = cfg.get("logging_steps", 10)
    if steps and steps > 0:
        allowed.add(float(math.ceil(steps / window)))
    trl = load_frameworks()["trl"]
    if res.framework == "trl":  # the prompt groups a generation batch holds, and how many the paired ledger needs
        d = {**trl.defaults, **cfg}
        allowed |= {float(trl.prompt_groups.minimum),
                    float(d["per_device_train_batch_size"] * d["gradient_accumulation_steps"] // d["num_generations"])}
    from reward_lens.power import FALSE_ALARM_BOUNDS, load_power

    power = load_power()
    for f in res.findings:  # how early a sequential finding catches its stated change: the numbers of
        d = f.detection  # specs/power.yaml and of its generated table (reward_lens/power.py), not invented
        if d is not None:
            g, m = (int(x) for x in d.read_at.split("x"))
            allowed |= {float(x) for x in (d.change, d.median, d.within_90, d.run_length, d.prompt_groups,
                                           d.completions, g, m, power.horizon) if x is not None}
            below = next(b for b in (*FALSE_ALARM_BOUNDS, 1.0) if d.false_alarm < b)
            allowed |= {round(100 * d.base) if d.unit == "points" else d.base, 100 * power.quantile,
                        float(f"{d.step_se:.2g}"), float(f"{100 * below:g}")}
            # the dispersion the simulation assumed, as the Detection states it
            allowed |= {float(f"{x:.2g}") for x in (d.icc, d.cv) if x is not None}
    for verbose in (False, True):
        text = audit_text(res, verbose=verbose)
        assert _numbers(text) <= allowed, (verbose, sorted(_numbers(text) - allowed), text)


def test_a_run_that_will_not_start_exits_one(tmp_path):
    """FSDP with the tap: the tap refuses at attach, so every book "will not run" and the audit
    exits 1 (it exited 0)."""
    p = _write(tmp_path, {**PER_STEP, "fsdp": "full_shard"})
    r = subprocess.run(CLI + ["audit", str(p), "--with-tap"], capture_output=True, text=True)
    assert r.returncode == 1 and "will not run" in r.stdout
    assert subprocess.run(CLI + ["audit", str(p), "--with-tap", "--fail-on", "never"]).returncode == 0
    tap = _write(tmp_path, {**PER_STEP, "per_device_train_batch_size": 16, "reward_lens": {}})
    assert subprocess.run(CLI + ["audit", str(tap)], capture_output=True).returncode == 0  # every book computes


def test_json_schema_is_committed_and_output_validates(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    import write_schemas

    for name, schema in write_schemas.schemas().items():  # audit, diff, and each book's section
        path = REPO / "specs" / "schemas" / name
        assert json.loads(path.read_text()) == json.loads(json.dumps(schema)), f"regenerate {name}: " \
            "python tools/write_schemas.py"
    assert json.loads((REPO / "specs" / "schemas" / "audit.schema.json").read_text()) == json_schema()
    r = subprocess.run(CLI + ["audit", str(CONFIGS / "verl_grpo.yaml"), "--format", "json"], capture_output=True,
                       text=True)
    assert r.returncode == 1  # veRL logs no D_t: a book would refuse, so the default --fail-on says 1
    data = json.loads(r.stdout)
    AuditOut.model_validate(data)  # extra keys forbidden: the schema is the whole contract
    assert data["schema_version"] == "1.0"
    assert set(data) == set(json_schema()["properties"])


def test_cli_arguments_first_collapsed_remedies_and_broken_pipe(tmp_path):
    cfg = CONFIGS / "trl_grpo_defaults.yaml"
    r = subprocess.run(CLI + ["audit", str(cfg), "--require", "bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and "--require names unknown book(s) ['bogus']" in r.stderr
    r = subprocess.run(CLI + ["audit", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 1  # books would refuse: --fail-on incomplete, the default, as in report
    assert subprocess.run(CLI + ["audit", str(cfg), "--fail-on", "never"], capture_output=True).returncode == 0
    # the first sentence names the key to change, and not one the config already sets: this
    # config logs completions, but one step in 10
    assert "Remedy: Set `logging_steps=1` in TRL's config" in " ".join(r.stdout.split())
    assert "log_completions=True" not in r.stdout.split("Remedy:")[1].split("\n\n")[0]
    assert "records every generation" not in r.stdout  # the rest is behind --verbose
    v = subprocess.run(CLI + ["audit", str(cfg), "--verbose"], capture_output=True, text=True)
    assert "records every generation" in " ".join(v.stdout.split()) and len(v.stdout) > len(r.stdout)
    w = subprocess.run(CLI + ["audit", str(_write(tmp_path, {**PER_STEP, "log_completions": False}))],
                       capture_output=True, text=True)
    assert "Remedy: Set `log_completions=True` (with `logging_steps=1`) in TRL's config" in " ".join(w.stdout.split())
    r = subprocess.run(CLI + ["audit", str(cfg), "--require", "cost"], capture_output=True, text=True)
    assert r.returncode == 1
    # a reader that closes the pipe early: no error, the exit code kept
    r = subprocess.run(f"{CLI[0]} audit {cfg} --format json --require cost | head -c 10; exit ${{PIPESTATUS[0]}}",
                       shell=True, executable="/bin/bash", capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr == "" and r.stdout == '{"schema_v'
    d = tmp_path / "not-a-record"
    d.mkdir()
    r = subprocess.run(CLI + ["audit", str(d)], capture_output=True, text=True)
    assert r.returncode == 2 and "without a manifest.json" in r.stderr and "Errno" not in r.stderr


def test_each_refusal_is_printed_once_per_distinct_remedy(tmp_path):
    text = audit_text(audit(_write(tmp_path, TRL_DEFAULTS), framework="trl"))
    assert text.count("RECORD_INCOMPLETE  (rollouts)") == 1
    assert text.count("RECORD_INCOMPLETE  (denominator)") == 1


def test_trl_cli_config_file_as_yaml(tmp_path):
    # The TRL CLI's --config file: script arguments and GRPOConfig arguments in one YAML.
    p = tmp_path / "grpo.yaml"
    p.write_text("model_name_or_path: some/model\ndataset_name: some/data\nnum_generations: 8\n"
                 "logging_steps: 1\nlog_completions: true\nbeta: 0.0\nmax_steps: 300\n")
    res = audit(p)
    assert res.framework == "trl"
    assert {r.requirement: r.cause.key for r in _cost(res).refusals} == {"denominator": "reward_lens"}


def test_unknown_tap_argument_is_bad_input(tmp_path):
    p = _write(tmp_path, {**PER_STEP, "reward_lens": {"estimater": "rollout"}})
    r = subprocess.run(CLI + ["audit", str(p)], capture_output=True, text=True)
    assert r.returncode == 2 and "estimater" in r.stderr and "config.json" in r.stderr


def test_tap_spec_defaults_match_the_tap():
    from reward_lens.taps.settings import TapSettings
    from reward_lens_spec import load_taps

    defaults = TapSettings()
    for key, value in load_taps()["trl"].defaults.items():
        assert getattr(defaults, key.split(".", 1)[1]) == value, key


@pytest.mark.parametrize("section, words", [
    ({"estimator": "bogus"}, "estimator"), ({"estimator": 42}, "estimator"), ({"flush_every": "ten"}, "flush_every"),
    ({"flush_every": -5}, "flush_every"), ({"paired": "no"}, "paired"), ({"heldout": 1.5}, "heldout"),
    ({"estimator": "rollout"}, "retired"), ({"paired": False}, "paired scoring")])
def test_tap_section_is_checked_against_the_taps_own_settings(tmp_path, section, words):
    """What the tap would raise on at attach, the audit refuses as bad input naming the key (it
    used to say "will compute" for `estimator: bogus`)."""
    p = _write(tmp_path, {**PER_STEP, "reward_lens": section})
    r = subprocess.run(CLI + ["audit", str(p), "--require", "cost"], capture_output=True, text=True)
    assert r.returncode == 2 and words in r.stderr and "reward_lens" in r.stderr, r.stderr


def test_audit_knows_the_feature_basis(tmp_path):
    from reward_lens.measure.ledger.basis import load_basis

    spec = tmp_path / "task.yaml"
    spec.write_text("features:\n  - name: correct\n    kind: reward\n    reward: correctness\n"
                    "  - name: length_tokens\n    kind: length\n    of: tokens\n"
                    "  - name: ends_eos\n    kind: ends_with_eos\n"
                    "  - name: fmt\n    kind: regex\n    pattern: \"^<answer>[0-9]+</answer>$\"\n")
    basis = load_basis(spec)
    cfg = _write(tmp_path, PER_STEP)
    plain = {f.name: f for f in audit(cfg, features=basis).features}
    assert plain["fmt"].verdict == "supported"
    assert plain["length_tokens"].verdict == "not supported" and plain["length_tokens"].cause.key == "reward_lens"
    assert plain["ends_eos"].verdict == "not supported"
    assert plain["correct"].verdict == "depends"  # a config does not name the reward functions
    tapped = {f.name: f.verdict for f in audit(cfg, features=basis, with_tap=True).features}
    assert tapped == {"correct": "depends", "length_tokens": "supported", "ends_eos": "supported", "fmt": "supported"}
    rec = {f.name: f for f in audit(PAIRED, features=basis).features}
    assert rec["correct"].verdict == "not supported" and "['lowercase']" in rec["correct"].says
    assert rec["ends_eos"].verdict == "supported"  # the tap records the EOS token
    old = {f.name: f for f in audit(LONG, features=basis).features}
    assert old["ends_eos"].verdict == "not supported"  # an imported record: no token ids, no EOS token
    r = subprocess.run(CLI + ["audit", str(cfg), "--features", str(spec), "--format", "json"], capture_output=True,
                       text=True)
    data = json.loads(r.stdout)
    assert data["basis"] == basis.basis_id and [f["name"] for f in data["features"]] == list(basis.names)


def test_fsdp_on_the_cpu_is_said_to_be_data_parallel_not_refused(tmp_path):
    """accelerate trains a TRL config with `fsdp` and `use_cpu` as DDP (checked in
    test_trl_tap_distributed.py): the tap attaches and records it as data-parallel, so the audit
    says that instead of 'will not run' -- except with `fsdp_version: 1`, where accelerate's FSDP
    plugin raises before the trainer exists; without use_cpu the tap still refuses FSDP1 at attach."""
    from reward_lens.audit import audit

    base = "num_generations: 8\nlogging_steps: 1\nmax_steps: 5\nfsdp: full_shard\nreward_lens: {}\n"
    cpu, gpu = tmp_path / "cpu.yaml", tmp_path / "gpu.yaml"
    cpu.write_text(base + "use_cpu: true\n")
    gpu.write_text(base)
    on_cpu = audit(cpu)
    assert all(b.verdict != "will not run" for b in on_cpu.books)
    assert any("does not apply it" in st.says and st.key == "fsdp" for st in on_cpu.statements)
    on_gpu = audit(gpu)
    assert all(b.verdict == "will not run" for b in on_gpu.books)
    assert "FSDP1" in on_gpu.books[0].cause.says and "fsdp_version: 2" in on_gpu.books[0].cause.says
    # FSDP2 is recorded: the books compute, and the audit says how pi_t is kept and what was tested
    fsdp2 = tmp_path / "fsdp2.yaml"
    fsdp2.write_text(base + "fsdp_config:\n  fsdp_version: 2\n")
    res = audit(fsdp2)
    assert _cost(res).verdict == "will compute"
    (said,) = [st.says for st in res.statements if st.key == "fsdp"]
    assert "each process's parameter shards" in said and "accelerate's plugin itself was not run" in said
    # with use_cpu: FSDP2's settings train data-parallel; FSDP1's make accelerate raise, the trainer's refusal
    for version, runs in ((2, True), (1, False)):
        cfg = tmp_path / f"cpu-v{version}.yaml"
        cfg.write_text(base + f"use_cpu: true\nfsdp_config:\n  fsdp_version: {version}\n")
        res = audit(cfg)
        said = [st.says for st in res.statements if st.key == "fsdp"]
        if runs:
            assert _cost(res).verdict == "will compute" and any("does not apply it" in x for x in said)
        else:
            assert all(b.verdict == "will not run" for b in res.books) and not any("does not apply it" in x for x in said)
            assert "raises as the trainer is made" in res.books[0].cause.says
            assert "drop `fsdp_config`" in res.books[0].cause.says
            assert all(f.verdict == "will not evaluate" for f in res.findings)  # nothing is logged to evaluate


def test_the_audit_says_what_the_taps_copy_of_pi_t_takes_and_where(tmp_path):
    """--model-parameters: bytes of the tap's snapshot from the parameter count and the dtype the
    config loads the model in (hand-worked: 7e9 x 2 bytes = 13.04 GiB; x 4 = 26.08 GiB)."""
    def snapshot_says(cfg, n=7 * 10**9):
        said = [s.says for s in audit(_write(tmp_path, cfg), with_tap=True, model_parameters=n).statements
                if s.key == "reward_lens.snapshot"]
        return said

    where, size = snapshot_says({**PER_STEP, "model_init_kwargs": {"dtype": "bfloat16"}})
    assert "on `device`" in where and "(tap default)" in where
    assert "13 GiB in bfloat16" in size and "on the accelerator, beside the model" in size
    assert "7,000,000,000 trainable parameters" in size
    _, size = snapshot_says({**PER_STEP, "reward_lens": {"snapshot": "cpu"}})
    assert "26.1 GiB in float32 or 13 GiB in bfloat16" in size and "in host memory: none on the accelerator" in size
    # without the count, where it is kept and nothing about bytes; without the tap, neither
    said = [s.says for s in audit(_write(tmp_path, PER_STEP), with_tap=True).statements if s.key == "reward_lens.snapshot"]
    assert len(said) == 1 and "GiB" not in said[0]
    assert not [s for s in audit(_write(tmp_path, PER_STEP), model_parameters=10**9).statements
                if s.key == "reward_lens.snapshot"]
    with pytest.raises(ValueError, match="snapshot: Input should be 'device' or 'cpu'"):
        audit(_write(tmp_path, {**PER_STEP, "reward_lens": {"snapshot": "gpu"}}))


def test_vllm_is_said_with_what_the_tap_records_of_it(tmp_path):
    res = audit(_write(tmp_path, {**PER_STEP, "use_vllm": True, "reward_lens": {}}))
    (said,) = [st.says for st in res.statements if st.key == "use_vllm"]
    assert "refuses a step pair whose sampler departs" in said and "vLLM itself was not run" in said
    assert res.fields["rollout.logp_sampler"].cadence == "every step"
    plain = audit(_write(tmp_path, {**PER_STEP, "reward_lens": {}}))
    # without vLLM the trained model samples its own rollouts: the one thing said of `use_vllm` is
    # that there is no engine to mismatch (engine_mismatch not evaluated), and nothing is recorded of one
    (said,) = [st.says for st in plain.statements if st.key == "use_vllm"]
    assert "no engine to depart from the policy" in said and "rollout.logp_sampler" not in plain.fields
    off = audit(_write(tmp_path, {**PER_STEP, "use_vllm": True, "vllm_importance_sampling_correction": False,
                                  "reward_lens": {}}))
    (said,) = [st.says for st in off.statements if st.key == "vllm_importance_sampling_correction"]
    assert "no importance-sampling correction" in said and "`engine_mismatch`" in said
