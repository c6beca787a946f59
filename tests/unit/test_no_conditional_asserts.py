"""No assert in the suite sits under a condition on the host (issue 63): an ``assert`` (or a
``np.testing.assert_*`` / ``pytest.raises`` check) nested in an ``if``, ``elif``, ``while`` or
conditional expression whose test reads the platform, the environment, the CPU, the user or
what is installed runs on some hosts and silently not on others -- on the CI host it may check
nothing. Such a check is made unconditional, or replaced by a case where the condition holds, or
the whole test is skipped by a marker that says why (which pytest reports; a silent ``if`` is
not reported anywhere).

The rule is syntactic, and so it is honest about what it covers: a test expression that names one
of ``HOST_NAMES`` (``sys.platform``, ``os.environ``, ``shutil.which``, ``os.geteuid``, ...). An
``if`` on a computed result that differs by host (the whitebox test's rung 2 was one) is outside
what a syntax scan can see; those were found by reading and are asserted as measured."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# Names whose value depends on the host a test runs on (attribute chains are matched on their
# dotted text, so ``sys.platform`` and ``platform.machine()`` both hit).
HOST_NAMES = ("sys.platform", "platform.", "os.name", "os.environ", "os.getenv", "getenv", "shutil.which",
              "cpu_count", "sched_getaffinity", "gethostname", "getuid", "geteuid", "getpass", "torch.cuda",
              "cuda.is_available", "find_spec", "sys.version_info", "machine(", "cpu_capability", "uname")


def _is_check(node: ast.AST) -> bool:
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.Call):
        f = ast.unparse(node.func)
        return f.startswith(("np.testing.assert", "numpy.testing.assert")) or f in ("pytest.raises", "pytest.warns")
    if isinstance(node, ast.With):
        return any(_is_check(item.context_expr) for item in node.items)
    return False


def host_conditional_checks(source: str, filename: str = "<test>") -> list[tuple[int, str]]:
    """(line, condition) of each check nested under a condition that reads the host."""
    tree = ast.parse(source, filename)
    out: list[tuple[int, str]] = []

    def host_test(test: ast.AST) -> str | None:
        text = ast.unparse(test)
        return text if any(n in text for n in HOST_NAMES) else None

    def visit(node: ast.AST, cond: str | None) -> None:
        if cond is not None and _is_check(node):
            out.append((node.lineno, cond))
            if isinstance(node, ast.With):  # its body may hold more checks; the with is one
                for child in node.body:
                    visit(child, cond)
                return
        if isinstance(node, (ast.If, ast.While)):
            c = host_test(node.test) or cond
            visit(node.test, cond)
            for child in node.body:
                visit(child, c)
            for child in node.orelse:  # the else branch runs on the other hosts: just as conditional
                visit(child, c)
            return
        if isinstance(node, ast.IfExp):
            c = host_test(node.test) or cond
            visit(node.test, cond)
            visit(node.body, c)
            visit(node.orelse, c)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, cond)

    visit(tree, None)
    return out


def test_no_check_in_the_suite_is_under_a_condition_on_the_host():
    found = []
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50  # the scan reads the suite
    for path in files:
        for line, cond in host_conditional_checks(path.read_text(), str(path)):
            found.append(f"{path.relative_to(TESTS.parent)}:{line} under `{cond}`")
    assert not found, "asserts that run on some hosts only:\n" + "\n".join(found)


def test_the_scan_finds_what_it_is_for():
    """The rule on cases written out: a check under a host condition (either branch, nested, in a
    conditional expression, a ``with pytest.raises``) is found; one under a condition on data,
    or a host condition with no check under it, is not."""
    src = '''
import os, sys, platform, shutil
import numpy as np
import pytest

def test_a():
    if sys.platform == "linux":
        assert 1 == 1                                   # 8
    else:
        np.testing.assert_allclose(1, 1)                # 10
    if os.environ.get("CI"):
        for x in range(3):
            if x:
                assert x                                # 14
    if shutil.which("chromium") is None:
        return
    y = 3
    if y > 2:
        assert y                                        # data, not host: not listed
    _ = (lambda: None) if platform.machine() == "x86_64" else None
    if os.geteuid() != 0:
        with pytest.raises(PermissionError):            # 22
            open("/root/x")
'''
    hits = host_conditional_checks(src)
    assert [line for line, _ in hits] == [8, 10, 14, 22], hits
    assert "sys.platform" in hits[0][1] and "os.environ" in hits[2][1] and "geteuid" in hits[3][1]
