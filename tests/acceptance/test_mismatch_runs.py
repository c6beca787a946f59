"""A reduced run of tools/mismatch_runs.py (slow): one cause and its matched clean run, through the
plain-torch tap with the stand-in engine, judged by the script's own rules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_top_p_in_the_engine_is_found_on_time_and_the_clean_run_stays_quiet(tmp_path):
    spec = importlib.util.spec_from_file_location("mismatch_runs", REPO / "tools" / "mismatch_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bad = mod.one("top_p", 11, 6, tmp_path)
    assert bad["truth_onset"] == mod.ONSET and bad["status"] == "holds" and bad["pass"], bad
    clean = mod.one("clean", 11, 6, tmp_path)
    assert clean["status"] == "clear" and not clean["live_held"] and clean["pass"], clean
