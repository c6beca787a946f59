"""reward-lens: what each optimizer step of an RL fine-tuning run spent (nats of policy divergence), what the behaviour change required, on which behaviours, and whether the run is healthy.

Exit codes (all subcommands):
  0  computed: nothing --fail-on counts (by default, no book is refused and the record lacks
     no input; audit: every book will compute)
  1  refused: what --fail-on counts happened (a normal outcome for an incomplete record; with
     --fail-on refused also any refusal, or a book with nothing resolved from noise); audit:
     a book would refuse, a --require'd book would, or the run will not start; check: a
     finding at or above --fail-on holds, or a --require'd finding is not evaluated
  2  bad input: an unreadable record, config or spec, or an output folder holding files
     reward-lens did not write; one line on stderr names the file and field (the
     traceback only with --debug)
  3  internal error: a bug in reward-lens, not in the input; one line on stderr, the
     traceback with --debug
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from contextlib import contextmanager
from pathlib import Path

EXIT_OK, EXIT_REFUSED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
FORMATS = ("md", "html", "json")


class Progress:
    """A one-line progress indicator on stderr, only when stderr is a terminal."""

    def __init__(self, quiet: bool):
        self.on = not quiet and sys.stderr.isatty()
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        if self.on:
            sys.stderr.write(f"\r\033[K[{time.monotonic() - self.t0:5.1f}s] {msg}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.on:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


CALLABLE_NOTE = (" A `callable` feature imports and runs the Python function it names: use only a basis you "
                 "wrote or trust (a basis is never read from a record or a report).")


@contextmanager
def _fewer_collections():
    """Cyclic garbage collection every 100,000 new objects instead of Python's 700, for one
    command: a report makes some hundreds of thousands of short-lived objects (rows, cells,
    lists of floats) and almost no cycles, and at 10,000 steps the default thresholds spent
    0.2 s in ~490 collections walking them (0.04 s in 5 with these)."""
    before = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _visible(text: str) -> str:
    """Text from a record or config, safe to print to a terminal: control characters (escape
    sequences included) shown as \\xNN."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in str(text))


# --fail-on, for report and audit alike: when is the outcome worth exit 1?
#   incomplete (default) -- a book is refused outright, or a refusal says the record lacks an
#                           input or the instrument failed (any code but PREMISE_FAILED, which
#                           is a limit of what some updates' samples can show); a healthy
#                           tapped run passes, an unresolved book (numbers, none resolved) too,
#                           and so do the step pairs a tap's budget chose not to measure (reason
#                           ``not_measured``: the record is whole, the tap did as it was told);
#   refused              -- any refusal at all, or any book that is not "computed";
#   violated             -- only ENVELOPE_VIOLATED;
#   never.
FAIL_ON = ("incomplete", "refused", "violated", "never")


def _exit_for(report, fail_on: str) -> int:
    refusals = report.refusals
    if fail_on == "never":
        return EXIT_OK
    if fail_on == "violated":
        return EXIT_REFUSED if any(r.severity == "violated" for r in refusals) else EXIT_OK
    if fail_on == "incomplete":
        bad = any(b.status == "refused" for b in report.books) or any(
            r.code != "PREMISE_FAILED" and (r.context or {}).get("reason") != "not_measured" for r in refusals)
        return EXIT_REFUSED if bad else EXIT_OK
    return EXIT_REFUSED if refusals or any(b.status != "computed" for b in report.books) else EXIT_OK


def _audit_exit(result, fail_on: str, required: set[str]) -> int:
    """The audit's exit code: 1 when a --require'd book would not compute, when the run will
    not start (the trainer or the tap refuses the config) unless --fail-on never, and under
    --fail-on incomplete or refused when any book would refuse."""
    if any(b.verdict != "will compute" and (b.book in required or b.function in required) for b in result.books):
        return EXIT_REFUSED
    if fail_on == "never":
        return EXIT_OK
    if any(b.verdict == "will not run" for b in result.books):
        return EXIT_REFUSED
    if fail_on in ("incomplete", "refused") and any(b.verdict != "will compute" for b in result.books):
        return EXIT_REFUSED
    return EXIT_OK


def _window(text: str) -> int | str:
    if text == "adaptive":
        return text
    try:
        w = int(text)
    except ValueError:
        w = 0
    if w < 1:
        raise ValueError(f"--window takes a positive number of step pairs or 'adaptive', not {text!r}")
    return w


def _pricing(args) -> int | str:
    """Check ``--ledger`` and ``--window`` (report and publish) before any work; the window."""
    from reward_lens.measure.efficiency.of_run import LEDGERS

    window = _window(args.window)
    if args.ledger not in LEDGERS:
        raise ValueError(f"--ledger takes one of {', '.join(LEDGERS)}, not {args.ledger!r}")
    return window


def _record_path(args) -> Path:
    from reward_lens.examples import example_record

    if args.example:
        if args.run_dir:
            raise ValueError("give a RUN_DIR or --example, not both")
        return example_record(args.example)
    if not args.run_dir:
        raise ValueError("give a RUN_DIR (a record directory) or --example NAME")
    return Path(args.run_dir)


def _reward_names(run) -> set[str] | None:
    """The reward functions of a record (the keys of its first rollouts' ``rewards``), or None
    where it has no per-function rewards."""
    if not run.n_rollouts or "rewards" not in run.rollout_columns():
        return None
    for table in run.iter_rollouts(["rewards"]):
        col = table.column("rewards").combine_chunks()
        return set(col.keys.unique().to_pylist())
    return None


def _targets(args, run, features) -> list:
    """``--target NAME[:higher|lower]`` (repeatable, or comma-separated), each resolved against
    the basis, the record's declared targets and its reward functions."""
    from reward_lens.measure.ledger.targets import parse_target, resolve

    texts = [t for arg in (args.target or []) for t in arg.split(",") if t.strip()]
    if not texts:
        return []
    rewards = _reward_names(run)
    out = []
    for text in texts:
        name, want = parse_target(text)
        out.append(resolve(name, want, features, run.manifest.targets, rewards))
    return out


TARGET_HELP = ("what you want of the policy, as opposed to what the reward pays for: a reward function of the record "
               "(TRL's reward_funcs names), a feature of the basis, or a check the tap recorded, with the direction "
               "you want (default higher); repeatable. Laid over the targets the tap recorded (attach's target=). "
               "Without any, proxy_gaming and paid_for_drift are not evaluated")


def cmd_report(args) -> int:
    from reward_lens.record.reader import open_run
    from reward_lens.report import build_report, to_html, to_json, to_markdown
    from reward_lens.report.output import check_owned, replace_dir_atomically

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"--format takes a comma-separated subset of {','.join(FORMATS)}, not {args.format!r}")
    out = Path(args.out)
    window = _pricing(args)
    check_owned(out, "report")  # before any work
    from reward_lens.measure.ledger.features import features_from

    from reward_lens.examples import example_features

    spec = args.features or (example_features(args.example) if args.example else None)
    features = features_from(spec)  # a bad basis file is named before any record is read
    progress = Progress(args.quiet)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="reward-lens-report-") as tmp:
        # a record, or a TRL output directory or veRL run folder imported on the fly (as `check` reads them)
        run, _ = _open_for_check(_record_path(args), Path(tmp))
        progress("verifying checksums")
        run.verify()  # a same-size edit of a data file is refused, naming the file
        progress("building the report")
        report = build_report(run, progress, ledger=args.ledger, window=window, features=features,
                              targets=_targets(args, run, features))
    progress("rendering")
    render = {"md": ("report.md", to_markdown), "html": ("report.html", to_html),
              "json": ("report.json", lambda r: to_json(r, pretty=args.pretty))}
    files = {render[f][0]: render[f][1](report) for f in formats}
    written = replace_dir_atomically(out, files, kind="report")
    progress.done()
    if not args.quiet:
        for b in report.books:
            _emit(f"{b.function}: {b.status}" + (f": {b.headline}" if b.headline else ""))
        for p in written:
            _emit(f"wrote {p}")
    return _exit_for(report, args.fail_on)


def audit_text(result, verbose: bool = False) -> str:
    """The text view of an audit: what the config says, one verdict line per book, and each
    distinct refusal once (naming every book it applies to), its remedy's first sentence
    unless ``verbose``."""
    lines = [f"audit of {_visible(result.source)}: {_visible(result.subject)} ({_visible(result.framework)} "
             f"{result.kind})"]
    lines += [f"  - {_visible(st.says)}" for st in result.statements]
    lines += ["", f"{'book':<17}{'verdict':<15}{'ledger':<10}still computable"]
    for b in result.books:
        still = ", ".join(b.still_computable) if b.refusals else ("everything" if b.verdict == "will compute" else "-")
        lines.append(f"{b.function:<17}{b.verdict:<15}{b.ledger or '-':<10}{still or '-'}")
    said: dict[str, list[str]] = {}
    for b in result.books:
        if b.cause is not None:
            said.setdefault(f"the run will not start: {_visible(b.cause.says)} (`{b.cause.key}` = "
                            f"{b.cause.value})", []).append(b.function)
        if b.ledger_cause is not None:
            said.setdefault(f"{b.ledger} ledger only: {_visible(b.ledger_cause.says)}", []).append(b.function)
    for text, functions in said.items():
        lines += ["", f"{', '.join(functions)}: {text}"]
    seen: dict[tuple[str, str, str], list[str]] = {}
    first: dict[tuple[str, str, str], object] = {}
    for b in result.books:
        for r in b.refusals:
            k = (r.code, r.requirement, r.remedy_first)
            seen.setdefault(k, []).append(b.function)
            first.setdefault(k, r)
    from reward_lens_spec.render import first_sentence, text_view

    for k, functions in seen.items():
        r = first[k]
        lines += ["", f"{', '.join(functions)}  {r.code}  ({r.requirement})",
                  text_view(_visible(r.detail if verbose else first_sentence(r.detail))),
                  text_view(_visible(r.remedy if verbose else r.remedy_first), lead="Remedy: ")]
    if result.features:
        lines += ["", f"feature basis {result.basis}", f"{'feature':<18}{'kind':<15}{'verdict':<15}why"]
        for f in result.features:
            lines.append(f"{f.name:<18}{f.kind:<15}{f.verdict:<15}{_visible(f.says)}")
    if result.findings:
        from reward_lens.findings import TARGET
        from reward_lens_spec.render import render_macro

        lines += ["", f"{'finding':<26}{'verdict':<19}needs"]
        for f in result.findings:
            needs = [render_macro("audit/says.j2", "no_target", what=m) if m == TARGET else m for m in f.missing]
            lines.append(f"{f.finding:<26}{f.verdict:<19}{', '.join(needs) or '-'}"
                         + (" (live)" if f.live and f.verdict == "will evaluate" and result.with_tap else ""))
        delays = [f.detection.says for f in result.findings if f.detection is not None]
        if delays:  # how early the sequential findings catch a change at this batch (reward_lens/power.py)
            lines += ["", render_macro("audit/says.j2", "detection_heading").strip()]
            lines += [text_view(_visible(d), indent="  ", lead="- ") for d in delays]
    if seen and not verbose:
        lines += ["", "(--verbose prints each refusal's whole detail and remedy)"]
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    """A count given as 7000000000, 7_000_000_000 or 7e9."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 1 and value == int(value) and value < 1e15):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of parameters from 1 to 1e15")
    return int(value)


def cmd_audit(args) -> int:
    from reward_lens.audit import audit
    from reward_lens_spec import load_books

    books = load_books()
    known = {b.id for b in books.values()} | {b.function for b in books.values()}
    unknown = set(args.require or []) - known
    if unknown:  # before any work
        raise ValueError(f"--require names unknown book(s) {sorted(unknown)}; books: {sorted(known)}")
    from reward_lens.measure.ledger.features import features_from

    basis = features_from(args.features) if args.features else None
    result = audit(args.config, framework=args.framework, with_tap=args.with_tap, features=basis,
                   model_parameters=args.model_parameters)
    if args.format == "json":
        _emit(result.model_dump_json())
    else:
        _emit(audit_text(result, verbose=args.verbose))
    return _audit_exit(result, args.fail_on, set(args.require or []))


def _emit(text: str) -> None:
    """Print to stdout; a reader that closed the pipe early (``| head``) ends the output
    quietly, and the exit code stays that of the command (``QuietPipe``)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class QuietPipe:
    """stdout for the length of one command: once the reader has closed the pipe (``| head -1``,
    ``| true``), every further write is dropped instead of raising BrokenPipeError, and the file
    descriptor is pointed at /dev/null so the interpreter's last flush cannot fail either. The
    command finishes its work and its exit code is kept, whatever it prints and wherever."""

    def __init__(self, stream):
        self._stream = stream
        self.broken = False

    def _quiet(self) -> None:
        import os

        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # a stream without a descriptor (a test's capture)
            pass

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._quiet()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._quiet()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def cmd_diff(args) -> int:
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.report.diff import diff_html, diff_json, diff_markdown, diff_reports, is_report_dir, load_side
    from reward_lens.report.output import check_owned, replace_dir_atomically

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"--format takes a comma-separated subset of {','.join(FORMATS)}, not {args.format!r}")
    out = Path(args.out)
    from reward_lens.examples import example_features, example_record

    given = [p for p in (args.run_a, args.run_b) if p]
    examples = args.example or []
    if len(given) + len(examples) != 2:
        raise ValueError(f"diff compares two runs: give two of RUN_A, RUN_B and --example NAME (got "
                         f"{len(given)} director{'y' if len(given) == 1 else 'ies'} and {len(examples)} --example)")
    sides = [Path(p) for p in given] + [example_record(n) for n in examples]
    spec = args.features
    if spec is None and examples:
        # the examples' own basis (`task` has one) when every example named shares it
        bases = {example_features(n) for n in examples}
        spec = str(bases.pop()) if len(bases) == 1 and None not in bases else None
    for side in sides:
        r_out, r_side = out.resolve(), side.resolve()
        if r_out == r_side or r_out in r_side.parents or r_side in r_out.parents:
            raise ValueError(f"--out {out} is {'inside ' if r_side in r_out.parents else ''}the input {side}: "
                             "the diff would replace what it compares; choose another --out")
    reports = [str(p) for p in sides if is_report_dir(p)]
    if args.features is not None and len(reports) == len(sides):
        raise ValueError(f"--features {args.features} applies to neither input ({', '.join(reports)} are report "
                         "directories, whose books were computed in the basis each report.json names). Give record "
                         "directories to read both in this basis")
    check_owned(out, "report")  # before any work
    features = features_from(spec)
    (a, la), (b, lb) = load_side(sides[0], features), load_side(sides[1], features)
    if la == lb:
        la, lb = f"A ({la})", f"B ({lb})"
    d = diff_reports(a, b, (la, lb))
    if d.status == "refused":  # a refusal is the answer, not an output: nothing written, --out left as it was
        _emit(d.refusal)
        return EXIT_REFUSED
    render = {"md": ("diff.md", diff_markdown), "html": ("diff.html", diff_html), "json": ("diff.json", diff_json)}
    written = replace_dir_atomically(out, {render[f][0]: render[f][1](d) for f in formats}, kind="report")
    if not args.quiet:
        _emit(d.refusal if d.refusal else f"compared {len(d.books)} books of {la} and {lb}")
        for p in written:
            _emit(f"wrote {p}")
    return EXIT_REFUSED if d.status == "refused" else EXIT_OK


def cmd_publish(args) -> int:
    from reward_lens.record.reader import open_run
    from reward_lens.report.model import SCHEMA_VERSION as REPORT_SCHEMA
    from reward_lens.report.site import publish

    from reward_lens.report.output import check_owned

    from reward_lens.measure.ledger.features import features_from

    site = Path(args.site)
    window = _pricing(args)
    check_owned(site, "site")  # before any work
    features = features_from(args.features)  # a bad basis file is named before any record is read
    progress = Progress(args.quiet)
    for p in args.run_dirs:  # a report folder where a record is wanted: say what it got and what it wants
        d = Path(p)
        if d.is_dir() and not (d / "manifest.json").exists() and (d / "report.json").is_file():
            raise ValueError(f"publish: {p} is a report folder (it has report.json, no manifest.json); publish "
                             "reads record directories (the folder the tap or `reward-lens import` wrote, with "
                             "manifest.json) and writes their reports itself")
    runs = [open_run(p) for p in args.run_dirs]
    for run in runs:
        run.verify()
    files, kept, older = publish(runs, site, progress, ledger=args.ledger, window=window, features=features,
                                 prune=args.prune)
    progress.done()
    if not args.quiet:
        _emit(f"wrote {len(files)} files to {args.site} (open {Path(args.site) / 'index.html'})")
        if kept:
            _emit(f"kept {len(kept)} run(s) already on the site ({', '.join(kept)}); --prune drops them")
        for slug, version in older:
            _emit(f"  {slug}: a report of schema {version} (this reward-lens writes {REPORT_SCHEMA}), listed without "
                  "numbers; publish its record again to show them")
    return EXIT_OK


def _open_for_check(path: Path, tmp: Path):
    """A record, or a framework's run folder imported on the fly into ``tmp``: a TRL output
    directory (``trainer_state.json``), as a record of its logged scalars where it has no
    completions, or a veRL run folder (its metric log, .hydra/config.yaml and dump folders,
    ``import_verl``'s ``find_run``). The findings its data supports are evaluated; the rest are not
    evaluated and name what they lack."""
    from reward_lens.record.importers.trl_output import state_file
    from reward_lens.record.reader import open_run

    manifest = path / "manifest.json"
    if not path.is_dir() or manifest.exists() or manifest.is_symlink():
        return open_run(path), str(path)
    state = state_file(path)
    if state is not None:
        from reward_lens.record.importers.trl_output import import_trl

        import_trl(path, tmp / "record", scalars_only_ok=True)
        read = state.relative_to(path).as_posix()
        return open_run(tmp / "record"), (f"{path} (a TRL output directory, read through `reward-lens import trl`: "
                                          f"its log from {read})")
    from reward_lens.record.importers.verl import find_run, import_verl

    found = find_run(path)
    if found is not None:
        import_verl(path, tmp / "record")
        read = found.metrics.relative_to(path).as_posix()
        return open_run(tmp / "record"), (f"{path} (a veRL run folder, read through `reward-lens import verl`: its "
                                          f"metrics from {read})")
    return open_run(path), str(path)


def cmd_check(args) -> int:
    import json
    import tempfile

    from reward_lens.findings import exit_code, finding_counts
    from reward_lens_spec import load_findings

    specs = load_findings()
    if args.list:
        _emit(render_findings_list(specs))
        return EXIT_OK
    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    if not formats or any(f not in ("md", "json") for f in formats):
        raise ValueError(f"--format takes md, json or md,json, not {args.format!r}")
    from reward_lens.examples import example_features
    from reward_lens.measure.ledger.features import features_from
    from reward_lens.report import build_report

    required = _required_findings(args.require, specs)  # before any work
    spec = args.features or (example_features(args.example) if args.example else None)
    features = features_from(spec)
    with tempfile.TemporaryDirectory(prefix="reward-lens-check-") as tmp:
        run, source = _open_for_check(_record_path(args), Path(tmp))
        run.verify()
        report = build_report(run, Progress(args.quiet), ledger=args.ledger, features=features,
                              targets=_targets(args, run, features))
    found = report.findings
    unmet = [f for f in found if f.id in required and f.status == "not_evaluated"]
    if "md" in formats:
        from reward_lens_spec.render import render_template

        _emit(render_template("report/check.md.j2", {"f": found, "n": finding_counts(found), "source": source,
                                                      "run_id": run.run_id, "fail_on": args.fail_on,
                                                      "unmet": unmet}, prose=False))
    if "json" in formats:
        from reward_lens.report.check import CheckOut

        _emit(CheckOut(run_id=run.run_id, source=source, counts=finding_counts(found), findings=list(found),
                       required_not_evaluated=[f.id for f in unmet]).model_dump_json())
    if unmet:
        return EXIT_REFUSED
    return exit_code(found, args.fail_on)


def _required_findings(texts, specs) -> set[str]:
    """``--require ID[,ID...]`` (repeatable): finding ids, each one of specs/findings/."""
    ids = {t.strip() for arg in (texts or []) for t in arg.split(",") if t.strip()}
    unknown = sorted(ids - set(specs))
    if unknown:
        raise ValueError(f"--require names unknown finding(s) {unknown}; the findings: {', '.join(sorted(specs))}")
    return ids


def render_findings_list(specs) -> str:
    from reward_lens.findings import findings_table

    return findings_table(specs)


def cmd_import(args) -> int:
    dest = Path(args.record_dir)
    if (dest.exists() or dest.is_symlink()) and not args.overwrite:  # before any work
        from reward_lens.record.errors import RecordError

        raise RecordError(dest, "a record already exists here; pass --overwrite to replace it (a record reward-lens "
                          "wrote is replaced, your own files in its folder are kept; another folder is never touched)")
    if args.validation and args.framework != "verl":
        raise ValueError("--validation reads veRL's validation dumps (`trainer.validation_data_dir`)")
    if args.framework in ("nemo-rl", "openrlhf"):
        return _import_registered(args)
    if args.rollouts and args.framework != "verl":
        raise ValueError("--rollouts reads veRL's generation dumps; a TRL output directory holds its own "
                         "completions_<step>.parquet")
    if args.framework == "verl":
        from reward_lens.record.importers.verl import import_verl

        m = import_verl(args.source, args.record_dir, framework_version=args.framework_version,
                        overwrite=args.overwrite, rollouts=args.rollouts, config=args.config,
                        validation=args.validation)
    else:
        from reward_lens.record.importers.trl_output import import_trl

        m = import_trl(args.source, args.record_dir, config=args.config, checkpoint=args.checkpoint,
                       framework_version=args.framework_version, overwrite=args.overwrite)
    if not args.quiet:
        _emit(f"wrote record {args.record_dir} ({m.run_id})")
        for note in m.notes:
            _emit(f"  note: {_visible(note)}")
    return EXIT_OK


def _import_registered(args) -> int:
    """``import nemo-rl|openrlhf``: the registered importer, which reads only its source."""
    from reward_lens.record.importers import importer

    given = [o for o, v in (("--config", args.config), ("--checkpoint", args.checkpoint), ("--rollouts", args.rollouts))
             if v]
    if given:
        raise ValueError(f"{', '.join(given)} are not read by `import {args.framework}` (see `reward-lens import "
                         f"{args.framework} --help` for what it reads)")
    m = importer(args.framework)(args.source, args.record_dir, framework_version=args.framework_version,
                                 overwrite=args.overwrite)
    if not args.quiet:
        _emit(f"wrote record {args.record_dir} ({m.run_id})")
        for note in m.notes:
            _emit(f"  note: {_visible(note)}")
    return EXIT_OK


class _ImportHelp(argparse.Action):
    """``import --help``, and after a framework (``import nemo-rl --help``) what that framework's
    import reads and where the run leaves it (specs/importers.yaml)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="show this help (after a framework: what it reads)")

    def __call__(self, p, namespace, values, option_string=None):
        p.print_help()
        name = getattr(namespace, "framework", None)
        from reward_lens_spec import load_importers

        spec = load_importers().importers.get(name) if name else None
        if spec is not None:
            from reward_lens_spec.render import render_template

            _emit(render_template("cli/import_help.txt.j2", {"name": name, "s": spec}, prose=False))
        p.exit()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reward-lens", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks on bad input")
    p.add_argument("--version", action="version", version=f"reward-lens {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("report", help="write the books of a record as Markdown, HTML and JSON",
                       epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("run_dir", nargs="?", help="a record directory")
    r.add_argument("--example", metavar="NAME", help="use a bundled reference record (gamed, task, long, short, "
                   "tapped, paired); `gamed` and `task` are read in their own bases, examples/features/NAME.yaml")
    r.add_argument("--out", default="reward-lens-report", help="output directory (default: ./reward-lens-report)")
    r.add_argument("--format", default="md,html,json", help="comma-separated: md,html,json (default: all)")
    r.add_argument("--fail-on", choices=FAIL_ON, default="incomplete",
                   help="exit 1 when a book is refused or the record lacks an input (incomplete, the default: a "
                   "healthy tapped run passes), on any refusal or unresolved book (refused), only on "
                   "ENVELOPE_VIOLATED (violated), or never")
    r.add_argument("--ledger", default="auto", help="auto (paired where the record has rollouts scored under the "
                   "previous policy, else unpaired), paired, or unpaired")
    r.add_argument("--window", default="1", help="price W consecutive step pairs together (ratio of sums), or "
                   "'adaptive': merge until resolved (default 1)")
    r.add_argument("--features", metavar="FILE", help="a feature basis (YAML, e.g. examples/features/task.yaml; "
                   "default: specs/features/surface.yaml)." + CALLABLE_NOTE)
    r.add_argument("--target", action="append", metavar="NAME[:higher|lower]", help=TARGET_HELP)
    r.add_argument("--pretty", action="store_true", help="indent report.json (compact by default)")
    r.add_argument("--quiet", action="store_true", help="no progress, no summary")
    r.set_defaults(func=cmd_report)

    a = sub.add_parser("audit", help="before training: which books will this logging config support?",
                       epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("config", help="TRL GRPOConfig arguments (YAML/JSON, e.g. the TRL CLI's --config file), a veRL "
                   "Hydra config, a record directory, or a record's manifest.json")
    a.add_argument("--framework", help="trl, verl or nemo_rl, when it cannot be told from the keys")
    a.add_argument("--format", choices=("table", "json"), default="table")
    a.add_argument("--require", action="append", metavar="BOOK", help="exit 1 if this book would refuse")
    a.add_argument("--fail-on", choices=FAIL_ON, default="incomplete",
                   help="exit 1 when any book would refuse (incomplete, the default; refused: the same), or never; "
                   "a run that will not start exits 1 unless never")
    a.add_argument("--with-tap", action="store_true", help="audit the run as recorded with RewardLensTap "
                   "(also implied by a `reward_lens:` section in the config)")
    a.add_argument("--verbose", action="store_true", help="print each refusal's whole detail and remedy")
    a.add_argument("--features", metavar="FILE", help="a feature basis (YAML): say which of its features the "
                   "logging setup supports." + CALLABLE_NOTE)
    a.add_argument("--model-parameters", type=_positive_int, metavar="N", help="the policy's trainable parameters: "
                   "with the tap, say the bytes its copy of pi_t takes and where")
    a.set_defaults(func=cmd_audit)

    dfp = sub.add_parser("diff", help="the books of two runs side by side (same feature basis required)")
    dfp.add_argument("run_a", nargs="?", help="a record directory, or a report directory (report.json)")
    dfp.add_argument("run_b", nargs="?", help="a record directory, or a report directory (report.json)")
    dfp.add_argument("--example", metavar="NAME", action="append", help="a bundled reference record (gamed, task, "
                     "long, short, tapped, paired) in place of a directory; twice for two (e.g. --example short "
                     "--example long); examples that share a basis of their own (task) are read in it")
    dfp.add_argument("--features", metavar="FILE", help="the feature basis both records are read in (default: "
                     "specs/features/surface.yaml); not for report directories." + CALLABLE_NOTE)
    dfp.add_argument("--out", default="reward-lens-diff", help="output directory (default: ./reward-lens-diff)")
    dfp.add_argument("--format", default="md,html,json", help="comma-separated: md,html,json (default: all)")
    dfp.add_argument("--quiet", action="store_true")
    dfp.set_defaults(func=cmd_diff)

    c = sub.add_parser("check", help="is this run healthy? the findings (specs/findings/), with onsets and remedies",
                       epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("run_dir", nargs="?", help="a record directory, or a TRL output directory (trainer_state.json: "
                   "the findings that need only logged scalars)")
    c.add_argument("--example", metavar="NAME", help="a bundled reference record (gamed, task, long, short, tapped, "
                   "paired); `gamed` and `task` are read in their own bases")
    c.add_argument("--fail-on", choices=("info", "warn", "critical", "never"), default="warn",
                   help="exit 1 when a finding of this severity or above holds (default warn)")
    c.add_argument("--format", default="md", help="md (a table on stdout), json, or md,json")
    c.add_argument("--features", metavar="FILE", help="the feature basis the book-based findings read (default: "
                   "specs/features/surface.yaml; the task example's own)." + CALLABLE_NOTE)
    c.add_argument("--ledger", default="auto", help="as for report: auto, paired or unpaired")
    c.add_argument("--target", action="append", metavar="NAME[:higher|lower]", help=TARGET_HELP)
    c.add_argument("--require", action="append", metavar="FINDING[,FINDING...]", help="exit 1 when a named finding "
                   "is not evaluated (e.g. proxy_gaming,paid_for_drift: a CI gate that fails where the run cannot be "
                   "judged, not only where it is judged unhealthy); ids as `check --list` gives them")
    c.add_argument("--list", action="store_true", help="list the findings, what each reads and how it was validated")
    c.add_argument("--quiet", action="store_true", help="no progress on stderr")
    c.set_defaults(func=cmd_check)

    s = sub.add_parser("publish", help="a static site of reports, one page per run, relative links only")
    s.add_argument("run_dirs", nargs="+", help="record directories")
    s.add_argument("--out", "--site", dest="site", required=True, metavar="DIR",
                   help="the site directory (replaced atomically); --site is the same option under its earlier name")
    s.add_argument("--features", metavar="FILE", help="the feature basis every run is read in (YAML, e.g. "
                   "examples/features/task.yaml; default: specs/features/surface.yaml)." + CALLABLE_NOTE)
    s.add_argument("--ledger", default="auto", help="as for report: auto, paired or unpaired, for every run")
    s.add_argument("--window", default="1", help="as for report: W step pairs priced together, or 'adaptive'")
    s.add_argument("--prune", action="store_true", help="drop the runs already on the site that are not published "
                   "now (they are kept, and listed, by default)")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_publish)

    from reward_lens_spec.paths import templates_dir

    i = sub.add_parser("import", help="convert a framework's output directory into a record", add_help=False,
                       epilog=(templates_dir() / "cli" / "import_help.txt").read_text(encoding="utf-8"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("-h", "--help", action=_ImportHelp)
    i.add_argument("framework", choices=("trl", "verl", "nemo-rl", "openrlhf"))
    i.add_argument("source", help="TRL: the output directory; veRL: the run folder (its metric log, "
                   ".hydra/config.yaml and dump folders are found in it) or the metric log itself (file logger JSON "
                   "lines or console output); NeMo-RL: the log folder; OpenRLHF: the TensorBoard folder")
    i.add_argument("record_dir", help="where to write the record")
    i.add_argument("--config", help="TRL: the trainer arguments as JSON/YAML (TRL saves them only as a pickle); "
                   "veRL: the run's Hydra config (.hydra/config.yaml), where the run folder does not hold it")
    i.add_argument("--checkpoint", help="the directory of the policy the run started from")
    i.add_argument("--rollouts", metavar="DUMP_DIR", help="veRL: the `trainer.rollout_data_dir` of the run "
                   "({step}.jsonl generation dumps), where the run folder does not hold it")
    i.add_argument("--validation", metavar="DUMP_DIR", help="veRL: the `trainer.validation_data_dir` of the run "
                   "(0.jsonl, ...: completions of the validation set), where the run folder does not hold it")
    i.add_argument("--framework-version", help="the framework version the run used")
    i.add_argument("--overwrite", action="store_true")
    i.add_argument("--quiet", action="store_true")
    i.set_defaults(func=cmd_import)
    return p


def _version() -> str:
    from reward_lens import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    stdout = sys.stdout
    sys.stdout = QuietPipe(stdout)  # from the first byte: `--help | head -1` is quiet too
    try:
        return _main(argv)
    finally:
        try:
            sys.stdout.flush()
        finally:
            sys.stdout = stdout


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    from reward_lens.record.errors import RecordError
    from reward_lens_spec import SpecError

    try:
        with _fewer_collections():
            code = args.func(args)
        sys.stdout.flush()  # inside the guard: a closed pipe is quiet here too
        return code
    except (RecordError, SpecError, ValueError, FileNotFoundError, OSError) as exc:
        if args.debug:
            raise
        msg = " ".join(str(exc).split())
        print(f"reward-lens: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("reward-lens: interrupted (nothing half-written)", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of ours: say so in one line, distinct from bad input
        if args.debug:
            raise
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        print(f"reward-lens: internal error: {msg} (a bug in reward-lens; --debug shows the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
