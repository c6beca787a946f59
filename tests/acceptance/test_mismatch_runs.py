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


@pytest.mark.slow
def test_the_live_tap_halts_a_run_whose_mismatch_reaches_the_updates(tmp_path, monkeypatch):
    """Top-p 0.2 in the engine (the scorer untruncated): a mismatch of many nats a sequence that
    reaches D_t from step 3 (exact). Trained with stop_on="critical", the tap signals the halt, and
    `check` on the record says critical: the live finding is `check` at every prefix, so the halt
    is at the first prefix at which check says critical (a prefix as the tap saw it: rollouts to
    step k, D_t to k - 1), after the critical onset check names by the steps its evidence needs."""
    spec = importlib.util.spec_from_file_location("mismatch_runs", REPO / "tools" / "mismatch_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "ENGINE_TOP_P", 0.2)
    got = mod.one("top_p", 11, 8, tmp_path)
    assert got["truth_critical"] == mod.ONSET, got
    assert got["halted"] is not None, got
    assert got["status"] == "holds" and got["severity"] == "critical" and got["onset"] == mod.ONSET, got
    assert got["live_is_check"] and got["halted"] == got["first_critical"] and got["halted"] > got["critical_from"], got
