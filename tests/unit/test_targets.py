"""Declared targets (issue 57): named where the user already is -- the tap's ``target=`` (the
manifest's ``targets``), ``--target NAME[:higher|lower]`` -- they reach the findings that tell
gaming from learning exactly as a basis file's ``target:`` does; the audit says "no target" where
none is declared and refuses a tap section attach would raise on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reward_lens import cli

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from test_live_findings import BASIS, hacked_record  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def gamed(tmp_path_factory):
    """The hand-made gamed run (test_live_findings.hacked_record) and its basis without a target."""
    d = tmp_path_factory.mktemp("gamed")
    (d / "plain.yaml").write_text(BASIS.replace("    target: higher\n", ""))
    (d / "targeted.yaml").write_text(BASIS)
    return hacked_record(d / "record"), d


def test_parse_and_mark():
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.measure.ledger.targets import parse_target, resolve, with_targets
    from reward_lens.record.schema import TargetDecl

    assert parse_target("vowels") == ("vowels", "higher") and parse_target("n_words:lower") == ("n_words", "lower")
    for bad in ("n_words:down", "9x", "a b", ""):
        with pytest.raises(ValueError, match="--target takes NAME or NAME:higher"):
            parse_target(bad)
    surface = SurfaceFeatures()
    assert resolve("n_words", "lower", surface, [], {"fmt"}).of == "feature"
    assert resolve("fmt", "higher", surface, [], {"fmt"}).of == "reward"
    assert resolve("v", "higher", surface, [TargetDecl(name="v", want="lower", of="check")], {"fmt"}).of == "check"
    with pytest.raises(ValueError, match=r"neither a reward function \(\['fmt'\]\)"):
        resolve("nope", "higher", surface, [], {"fmt"})
    marked = with_targets(surface, [TargetDecl(name="n_words", want="lower", of="feature")])
    # a target on a feature the basis has is not part of the basis id; an added one is a feature
    assert marked.targets == {"n_words": "lower"} and marked.basis_id == surface.basis_id
    added = with_targets(surface, [TargetDecl(name="fmt", want="higher", of="reward"),
                                   TargetDecl(name="v", want="lower", of="check")])
    assert list(added.names)[-2:] == ["fmt", "v"] and added.targets == {"fmt": "higher", "v": "lower"}
    assert added.needs()["v"] == [["rollout.targets"]]
    assert with_targets(surface, []) is surface


def _check(args) -> tuple[int, dict]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["check", *args, "--format", "json", "--quiet"])
    return code, {f["id"]: f for f in json.loads(buf.getvalue())["findings"]}


def test_target_on_the_command_line_is_the_basis_files_target(gamed):
    record, d = gamed
    code_plain, plain = _check([str(record), "--features", str(d / "plain.yaml")])
    assert plain["proxy_gaming"]["status"] == "not_evaluated" and plain["paid_for_drift"]["status"] == "not_evaluated"
    code_file, by_file = _check([str(record), "--features", str(d / "targeted.yaml")])
    code_flag, by_flag = _check([str(record), "--features", str(d / "plain.yaml"), "--target", "correct"])
    assert by_file["proxy_gaming"]["status"] == "holds"
    for fid in ("proxy_gaming", "paid_for_drift"):
        assert (by_flag[fid]["status"], by_flag[fid]["onset"], by_flag[fid]["evidence"]) == (
            by_file[fid]["status"], by_file[fid]["onset"], by_file[fid]["evidence"])
    assert code_flag == code_file == 1
    # a reward function of the record, named without any basis file: added to the surface basis
    _, by_reward = _check([str(record), "--target", "correctness"])
    assert by_reward["proxy_gaming"]["status"] == "holds" and "`correctness`" in by_reward["proxy_gaming"]["evidence"]


def test_the_manifest_declares_the_target_and_every_reading_reads_it(gamed, tmp_path):
    from reward_lens.record import open_run
    from reward_lens.record.schema import TargetDecl, content_run_id

    record, d = gamed
    run = open_run(record)
    assert run.manifest.targets == []
    rows = run.read_rollouts(run.rollout_columns())
    tel = run.telemetry
    from reward_lens.record import OptimizerTelemetry, write_run

    telemetry = [OptimizerTelemetry(**{k: v for k, v in r.items() if v is not None}) for r in tel.to_pylist()]
    declared = write_run(tmp_path / "rec", framework={"name": "test", "version": "0"},
                         model={"description": "hand-made"}, telemetry=telemetry, rollouts=rows,
                         targets=[TargetDecl(name="correctness", want="higher", of="reward")])
    assert declared.targets[0].of == "reward"
    # an empty `targets` is not hashed: every earlier record keeps its id
    assert content_run_id(run.manifest) == run.run_id
    _, found = _check([str(tmp_path / "rec"), "--features", str(d / "plain.yaml")])
    assert found["proxy_gaming"]["status"] == "holds"
    # --target lays a direction over the record's: wanting less correctness, its fall is no gaming
    _, over = _check([str(tmp_path / "rec"), "--features", str(d / "plain.yaml"), "--target", "correctness:lower"])
    assert over["proxy_gaming"]["status"] == "clear"


def test_a_check_target_is_read_from_the_targets_column(tmp_path):
    import numpy as np
    import pyarrow as pa

    from reward_lens.measure.ledger.basis import FeatureBasis, CheckDef
    from reward_lens.record.errors import RecordError
    from reward_lens.record.writer import _rollouts_table
    from reward_lens.record.schema import Rollout

    rows = [Rollout(step=0, group_id="0:0", prompt="p", completion="abc", targets={"vowels": 0.25}),
            Rollout(step=0, group_id="0:0", prompt="p", completion="xyz", targets={"vowels": 0.0})]
    table = _rollouts_table(rows)
    basis = FeatureBasis([CheckDef(kind="check", name="vowels", check="vowels", target="higher")])
    assert np.allclose(basis.compute(table)[:, 0], [0.25, 0.0])
    missing = table.set_column(table.column_names.index("targets"), "targets",
                               pa.array([[("other", 1.0)], [("other", 1.0)]], table.schema.field("targets").type))
    with pytest.raises(RecordError, match=r"reads check `vowels`, which no rollout has \(the record's checks: \['other'\]\)"):
        basis.compute(missing)


def _audit(tmp_path, section: str, name="c.yaml") -> tuple[int, str]:
    import contextlib
    import io

    cfg = tmp_path / name
    cfg.write_text("num_generations: 8\nper_device_train_batch_size: 16\nlogging_steps: 1\nmax_steps: 50\n"
                   f"log_completions: true\nreward_lens: {section}\n")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["audit", str(cfg)])
    return code, out.getvalue() + err.getvalue()


def test_the_audit_says_no_target_and_refuses_what_attach_raises_on(tmp_path):
    code, text = _audit(tmp_path, "{stop_on: critical}")
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.strip()}
    for fid in ("proxy_gaming", "paid_for_drift"):
        assert "will not evaluate  no target:" in lines[fid] and "target=" in lines[fid]
    code, text = _audit(tmp_path, "{stop_on: critical, target: 'correctness'}")
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.strip()}
    assert "will evaluate" in lines["proxy_gaming"] and "(live)" in lines["proxy_gaming"]
    code, text = _audit(tmp_path, "{features: nope.yaml}")
    assert code == 1 and "`reward_lens.features` = nope.yaml" in text and "not a file" in text
    code, text = _audit(tmp_path, "{stop_on: critical, check_every: 0}")
    assert code == 1 and "`reward_lens.check_every` = 0" in text and "can never stop the run" in text
    code, _ = _audit(tmp_path, "{stop_on: critical, check_every: 2}")
    assert code == 0


def test_the_tap_refuses_the_same_pair_and_a_bad_target_at_attach():
    from reward_lens.taps.settings import tap_settings

    with pytest.raises(ValueError, match="can never stop the run with check_every=0"):
        tap_settings(stop_on="critical", check_every=0)
    with pytest.raises(ValueError, match="'x:up' is not a target name"):
        tap_settings(target="x:up")
    with pytest.raises(ValueError, match="no usable name"):
        tap_settings(target=lambda completions, **kw: [0.0] * len(completions))

    def vowels(completions, **kw):
        return [0.0] * len(completions)

    got = tap_settings(target=["fmt", {"vowels:lower": vowels}]).target
    assert [(t.name, t.want, t.fn) for t in got] == [("fmt", "higher", None), ("vowels", "lower", vowels)]
    with pytest.raises(ValueError, match="declared twice"):
        tap_settings(target=["a", "a:lower"])


def test_the_core_resolves_a_target_against_the_trainers_reward_functions():
    from reward_lens.measure.ledger.features import SurfaceFeatures
    from reward_lens.taps.core import declared_targets
    from reward_lens.taps.settings import tap_settings

    def vowels(completions, **kw):
        return [0.0] * len(completions)

    s = tap_settings(target=["fmt", "n_words:lower", {"vowels": vowels}])
    got = declared_targets(s.target, SurfaceFeatures(), ["fmt", "length"])
    assert [(t.name, t.of, t.want) for t in got] == [("fmt", "reward", "higher"), ("n_words", "feature", "lower"),
                                                      ("vowels", "check", "higher")]
    with pytest.raises(ValueError, match=r"neither a reward function of the trainer \(\['fmt'\]\)"):
        declared_targets(tap_settings(target="nope").target, SurfaceFeatures(), ["fmt"])
    with pytest.raises(ValueError, match="named like the reward function"):
        declared_targets(tap_settings(target={"fmt": vowels}).target, SurfaceFeatures(), ["fmt"])


def test_a_target_the_basis_already_reads_is_marked_not_copied():
    """The task basis reads reward function `correctness` as `correct`: a tap's target="correctness"
    marks that feature (the same basis id, the same books), never adds a collinear copy."""
    from reward_lens.measure.ledger.basis import load_basis
    from reward_lens.measure.ledger.targets import with_targets
    from reward_lens.record.schema import TargetDecl

    task = load_basis(REPO / "examples" / "features" / "task.yaml")
    both = with_targets(task, [TargetDecl(name="correctness", want="higher", of="reward")])
    assert list(both.names) == list(task.names) and both.basis_id == task.basis_id
    assert both.targets == {"correct": "higher"}
    fmt = with_targets(task, [TargetDecl(name="format", want="lower", of="reward")])
    assert fmt.targets == {"correct": "higher", "reward_format": "lower"} and list(fmt.names) == list(task.names)


def test_the_basis_page_shows_every_kind_the_loader_accepts(tmp_path):
    """docs/basis.md: one example per kind, each loading as written (a `callable` needs its module)."""
    import re

    import yaml

    from reward_lens.measure.ledger.basis import KINDS, load_basis

    text = (REPO / "docs" / "basis.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    shown = set()
    for block in blocks[1:]:  # the first is the annotated whole file
        feats = yaml.safe_load(block)
        shown |= {f["kind"] for f in feats}
        if any(f["kind"] == "callable" for f in feats):
            continue
        path = tmp_path / "b.yaml"
        path.write_text(yaml.safe_dump({"features": feats}))
        assert load_basis(path).names
    assert shown == set(KINDS)
    (tmp_path / "whole.yaml").write_text(blocks[0])
    assert load_basis(tmp_path / "whole.yaml").targets == {"correct": "higher"}


def test_version_and_publish_out(tmp_path, capsys):
    from reward_lens import __version__

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"reward-lens {__version__}"
    # publish takes --out like every other command (--site kept), and names a report folder given for a record
    rep = tmp_path / "rep"
    rep.mkdir()
    (rep / "report.json").write_text("{}")
    for flag in ("--out", "--site"):
        assert cli.main(["publish", str(rep), flag, str(tmp_path / "site"), "--quiet"]) == cli.EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert "is a report folder (it has report.json, no manifest.json)" in err and "record directories" in err
    assert not (tmp_path / "site").exists()
