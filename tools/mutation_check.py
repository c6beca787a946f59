"""Mutation check of the decisions and intervals (issue 63): single-line slips in the code that
turns the estimators' numbers into decisions and intervals -- a p-value, a BH threshold, an SE
factor, the CUSUM's parameters -- applied one at a time, each followed by the unit tests of that
code. A mutant that no test fails *survived*: docs/reliability.md lists the survivors.

It never touches the working tree it is run from: the tracked and untracked (not ignored) files
are copied to a temporary folder and each mutant is written, tested and restored THERE. Only
``tests/unit`` counts as a catch; ``tests/acceptance/test_reports.py`` (the stored reports, whose
remedy is to regenerate them, which would ship the bug) is never run.

Mutants are made from the lines of the functions and constants named in ``TARGETS`` by the
operators in ``OPERATORS`` (operators, comparison flips, constants such as ``2 *``, ``K = 1.0``,
``(g - 1) / g``); ``NAMED`` are the issue's three and always run. The rest are a seeded sample,
capped by ``--max`` so that a run stays bounded (each mutant runs its module's unit tests in one
pytest process, the fast independent cases first, stopping at the first failure).

    .venv/bin/python tools/mutation_check.py --max 40            # prints a table; exit 1 on survivors
    .venv/bin/python tools/mutation_check.py --list              # the mutants only, nothing run
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# file -> (the names whose lines are mutated: functions, methods as Class.method, module constants;
#          the unit test files run against its mutants, fastest-catching first)
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "reward_lens/measure/decisions.py": (
        ("decide_from", "t_dof", "t_dofs"),
        ("tests/unit/test_independent_cases.py", "tests/unit/test_books.py", "tests/unit/test_kl_min_columns.py"),
    ),
    "reward_lens/measure/sequential.py": (
        ("K", "U_MAX", "normal_scores", "false_alarm_probability", "SeriesWatch.observe", "SeriesWatch.observe_many",
         "OneSided.add"),
        ("tests/unit/test_independent_cases.py", "tests/unit/test_sequential.py"),
    ),
    "reward_lens/measure/efficiency/eta.py": (
        ("FDR_Q", "benjamini_hochberg", "_ratio_se", "ratio_ses", "_t975", "t975s", "jackknife_dof",
         "jackknife_dofs", "paired_estimate_columns", "EtaEstimate.interval"),
        ("tests/unit/test_independent_cases.py", "tests/unit/test_eta_small_groups.py",
         "tests/unit/test_cost_columns.py", "tests/unit/test_paired_se.py"),
    ),
    "reward_lens/measure/ledger/paired.py": (
        ("Strata.__init__", "Strata.jackknife", "Segments.jackknife"),
        ("tests/unit/test_independent_cases.py", "tests/unit/test_paired_se.py", "tests/unit/test_segments.py"),
    ),
}
# The first file of each list runs alone first (its cases are written for these mutants and take
# seconds); the rest, in one pytest process, only for a mutant it did not catch.

# (name, pattern, replacement): each occurrence of the pattern on a target line is one mutant
OPERATORS: tuple[tuple[str, str, str], ...] = (
    ("drop 2 *", r"\b2 \* ", ""),
    ("(g - 1) / g inverted", r"\(g - 1\) / g\b", "g / (g - 1)"),
    ("/ (g - 1) -> / g", r"/ \(g - 1\)", "/ g"),
    ("(m - 1) / m inverted", r"\(m - 1\) / m\b", "m / (m - 1)"),
    ("<= -> <", r"<=", "<"),
    (">= -> >", r">=", ">"),
    ("< -> <=", r"(?<![<=])<(?![<=])", "<="),
    ("> -> >=", r"(?<![>=-])>(?![>=])", ">="),
    ("- -> +", r"(?<=\w|\)) - (?=\w|\()", " + "),
    ("+ -> -", r"(?<=\w|\)) \+ (?=\w|\()", " - "),
    ("* -> /", r"(?<=\w|\)) \* (?=\w|\()", " / "),
    ("0.975 -> 0.95", r"0\.975\b", "0.95"),
    ("1.959963984540054 -> 1.645", r"1\.959963984540054", "1.6448536269514722"),
    ("- 1 -> - 2", r" - 1\b(?!\.\d)", " - 2"),
    ("max -> min", r"\bnp\.maximum\b", "np.minimum"),
)
# constants: NAME = value -> other values
CONSTANTS = {"K": ("0.5", "1.5"), "U_MAX": ("4.0",), "FDR_Q": ("0.1", "0.01")}
# the three: a one-sided p, K = 0.5, the jackknife's factor inverted (always run)
NAMED = (
    ("reward_lens/measure/decisions.py", "p = 2 * np.where(", "p = np.where("),
    ("reward_lens/measure/sequential.py", "K = 1.0", "K = 0.5"),
    ("reward_lens/measure/efficiency/eta.py", "(g - 1) / g * dev", "g / (g - 1) * dev"),
)


@dataclass(frozen=True)
class Mutant:
    path: str
    line: int  # 1-based
    old: str
    new: str
    what: str

    def label(self) -> str:
        return f"{self.path}:{self.line} [{self.what}] {self.old.strip()}  ->  {self.new.strip()}"


def _spans(tree: ast.Module, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """Line spans (1-based, inclusive) of the named functions, Class.method and module constants,
    docstrings excluded."""
    out = []

    def body_span(node) -> tuple[int, int]:
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                and isinstance(first.value.value, str) and len(node.body) > 1:
            return node.body[1].lineno, node.end_lineno
        return node.lineno, node.end_lineno

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            out.append(body_span(node))
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and f"{node.name}.{sub.name}" in names:
                    out.append(body_span(sub))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in names for t in targets):
                out.append((node.lineno, node.end_lineno))
    return out


def mutants_of(path: str, names: tuple[str, ...]) -> list[Mutant]:
    text = (ROOT / path).read_text()
    lines = text.splitlines(keepends=True)
    out = []
    spans = _spans(ast.parse(text), names)
    if len(spans) != len(names):
        raise SystemExit(f"mutation_check: {path}: {len(names)} names in TARGETS, {len(spans)} found: update TARGETS")
    for lo, hi in spans:
        for i in range(lo - 1, hi):
            line = lines[i]
            code = line.split("#", 1)[0]
            if not code.strip() or code.lstrip().startswith(("def ", "class ", '"""', "'")):
                continue
            m = re.match(r"\s*([A-Z_]+) = ", code)
            if m and m.group(1) in CONSTANTS:
                value = code.split("=", 1)[1].strip()
                for other in CONSTANTS[m.group(1)]:
                    out.append(Mutant(path, i + 1, line, line.replace(value, other, 1), f"{m.group(1)} = {other}"))
                continue
            for what, pat, rep in OPERATORS:
                for hit in re.finditer(pat, code):
                    new = line[:hit.start()] + re.sub(pat, rep, hit.group(0)) + line[hit.end():]
                    out.append(Mutant(path, i + 1, line, new, what))
    return out


def named_mutants() -> list[Mutant]:
    out = []
    for path, old, new in NAMED:
        lines = (ROOT / path).read_text().splitlines(keepends=True)
        hits = [i for i, ln in enumerate(lines) if old in ln]
        if len(hits) != 1:
            raise SystemExit(f"mutation_check: {path}: {old!r} found {len(hits)} times, not once")
        ln = lines[hits[0]]
        out.append(Mutant(path, hits[0] + 1, ln, ln.replace(old, new, 1), "issue 63"))
    return out


def _compiles(text: str) -> bool:
    try:
        compile(text, "<mutant>", "exec")
    except SyntaxError:
        return False
    return True


def copy_tree(dest: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files, copied to ``dest``."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = ROOT / os.fsdecode(f)
        if src.is_symlink() or not src.is_file():
            continue
        dst = dest / os.fsdecode(f)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, str, float]:
    """('caught', the first test that failed) / ('survived', '') / ('timeout', ''): the files in
    one pytest process (one import of the package), stopping at the first failure."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", *tests, "-x", "-q", "-m", "not slow", "-p",
                               "no:cacheprovider", "--ignore=tests/acceptance", "-rf", "--tb=no"], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.monotonic() - start
    secs = time.monotonic() - start
    if done.returncode == 0:
        return "survived", "", secs
    failed = [ln.split(" ", 1)[1].split(" - ")[0] for ln in done.stdout.splitlines() if ln.startswith("FAILED ")]
    return "caught", failed[0] if failed else f"pytest exit {done.returncode}", secs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=int, default=40, help="mutants to run, the issue's three included (default 40)")
    ap.add_argument("--seed", type=int, default=63)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's tests before it counts as hung")
    ap.add_argument("--list", action="store_true", help="print the mutants that would run; run nothing")
    ap.add_argument("--only", action="append", default=[], metavar="PATH:LINE",
                    help="run only the mutants of this line (repeatable): to rerun survivors after adding a test")
    args = ap.parse_args(argv)

    named = named_mutants()
    pool = []
    for path, (names, _) in TARGETS.items():
        text = (ROOT / path).read_text()
        for m in mutants_of(path, names):
            lines = text.splitlines(keepends=True)
            lines[m.line - 1] = m.new
            if m.new != m.old and _compiles("".join(lines)) and all((m.path, m.line, m.new) != (n.path, n.line, n.new)
                                                                    for n in named):
                pool.append(m)
    # constants first (each is a decision's parameter), then a seeded sample of the rest
    consts = [m for m in pool if "=" in m.what and m.what.split(" = ")[0] in CONSTANTS]
    rest = [m for m in pool if m not in consts]
    random.Random(args.seed).shuffle(rest)
    chosen = (named + consts + rest)[:max(args.max, len(named))]
    if args.only:
        chosen = [m for m in named + consts + rest if f"{m.path}:{m.line}" in args.only]
    print(f"mutation_check: {len(pool) + len(named)} mutants generated, {len(chosen)} run", flush=True)
    if args.list:
        for m in chosen:
            print(m.label())
        return 0

    with tempfile.TemporaryDirectory(prefix="reward-lens-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        every = tuple(dict.fromkeys(t for _, tests in TARGETS.values() for t in tests))
        status, where, secs = run_tests(tree, every, args.timeout)  # the unmutated tree passes, or nothing is measured
        print(f"mutation_check: the unmutated tree passes {len(every)} test files in {secs:.0f} s", flush=True)
        if status != "survived":
            print(f"mutation_check: the unmutated tree fails {where} ({status}): fix that first", file=sys.stderr)
            return 2
        survivors = []
        for i, m in enumerate(chosen, 1):
            target = tree / m.path
            original = target.read_text()
            lines = original.splitlines(keepends=True)
            assert lines[m.line - 1] == m.old, m
            lines[m.line - 1] = m.new
            target.write_text("".join(lines))
            try:
                first, *rest = TARGETS[m.path][1]
                status, where, secs = run_tests(tree, (first,), args.timeout)
                if status == "survived" and rest:
                    status, where, more = run_tests(tree, tuple(rest), args.timeout)
                    secs += more
            finally:
                target.write_text(original)
            print(f"{i:3d} {status:8s} {secs:6.1f}s  {m.label()}" + (f"   <- {where}" if where else ""), flush=True)
            if status == "survived":
                survivors.append(m)
        print(f"mutation_check: {len(chosen) - len(survivors)} of {len(chosen)} caught; survivors:")
        for m in survivors:
            print(f"  {m.label()}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
