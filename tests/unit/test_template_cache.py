"""The compiled-template cache (Jinja's FileSystemBytecodeCache): it must never change what a
template renders. Each test points the cache at its own directory through the same class the
package uses."""

from __future__ import annotations

import os

import jinja2
import pytest

from reward_lens_spec import render as spec_render


def _env(root, cache_dir, tag, autoescape):
    cache = spec_render._CompiledTemplates(tag)
    cache.directory = str(cache_dir)
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(root)), bytecode_cache=cache, autoescape=autoescape)


def test_a_template_compiled_with_autoescape_is_never_served_without_it(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.j2").write_text("{{ v }}")
    cache = tmp_path / "cache"
    cache.mkdir()
    assert _env(tmp_path / "t", cache, "html", True).get_template("x.j2").render(v="<b>") == "&lt;b&gt;"
    assert len(os.listdir(cache)) == 1  # it was cached
    # the same template, the same cache directory, another environment: compiled again, not loaded
    assert _env(tmp_path / "t", cache, "text", False).get_template("x.j2").render(v="<b>") == "<b>"
    assert len(os.listdir(cache)) == 2
    # and a fresh html environment loads the cached code, which still escapes
    assert _env(tmp_path / "t", cache, "html", True).get_template("x.j2").render(v="<b>") == "&lt;b&gt;"


def test_an_edited_template_is_compiled_again(tmp_path):
    (tmp_path / "t").mkdir()
    src = tmp_path / "t" / "x.j2"
    src.write_text("one {{ v }}")
    cache = tmp_path / "cache"
    cache.mkdir()
    assert _env(tmp_path / "t", cache, "text", False).get_template("x.j2").render(v=1) == "one 1"
    src.write_text("two {{ v }}")
    assert _env(tmp_path / "t", cache, "text", False).get_template("x.j2").render(v=1) == "two 1"


def test_a_cache_that_cannot_be_written_is_passed_over(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.j2").write_text("{{ v }}")
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("a file where the cache directory should be")  # even root cannot write in it
    assert _env(tmp_path / "t", not_a_dir, "text", False).get_template("x.j2").render(v=3) == "3"
    assert not_a_dir.read_text() == "a file where the cache directory should be"


def test_a_missing_cache_directory_is_passed_over(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.j2").write_text("{{ v }}")
    assert _env(tmp_path / "t", tmp_path / "nowhere", "text", False).get_template("x.j2").render(v=4) == "4"


def test_a_corrupt_cache_entry_is_compiled_again(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.j2").write_text("{{ v }}!")
    cache = tmp_path / "cache"
    cache.mkdir()
    _env(tmp_path / "t", cache, "text", False).get_template("x.j2")
    (entry,) = cache.iterdir()
    entry.write_bytes(entry.read_bytes()[:40])  # magic and checksum intact, code cut short
    assert _env(tmp_path / "t", cache, "text", False).get_template("x.j2").render(v=5) == "5!"


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("REWARD_LENS_TEMPLATE_CACHE", "0")
    assert spec_render.compiled_templates("text") is None
    monkeypatch.setenv("REWARD_LENS_TEMPLATE_CACHE", "1")
    assert isinstance(spec_render.compiled_templates("text"), jinja2.FileSystemBytecodeCache)


def test_the_package_environments_never_share_compiled_code():
    from reward_lens.report.render import environment
    from reward_lens_spec.paths import templates_dir

    root = str(templates_dir())
    envs = [environment(root, True), environment(root, False), spec_render._env(root)]
    patterns = [e.bytecode_cache.pattern for e in envs if e.bytecode_cache is not None]
    assert len(set(patterns)) == len(patterns) == 3


# ---- where compiled templates are kept (issue 31: never a directory another user can plant) ----

def _cache_home(monkeypatch, tmp_path):
    home = tmp_path / "cache-home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def test_compiled_templates_live_in_the_users_private_cache_dir(monkeypatch, tmp_path):
    import stat
    import tempfile

    home = _cache_home(monkeypatch, tmp_path)
    where = spec_render.cache_directory()
    assert where == home / "reward-lens" / "templates"
    assert stat.S_IMODE(os.lstat(where).st_mode) == 0o700
    cache = spec_render.compiled_templates("text")
    assert cache is not None and cache.directory == str(where)
    assert not str(where).startswith(tempfile.gettempdir() + os.sep + "_jinja2")


def test_a_planted_symlink_is_not_followed_or_chmod_ed(monkeypatch, tmp_path):
    import stat

    home = _cache_home(monkeypatch, tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    victim.chmod(0o755)
    (home / "reward-lens").mkdir(mode=0o700)
    (home / "reward-lens" / "templates").symlink_to(victim)
    assert spec_render.cache_directory() is None
    assert spec_render.compiled_templates("text") is None  # compiled each time instead
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o755  # untouched


def test_a_directory_others_can_write_or_own_is_never_loaded_from(monkeypatch, tmp_path):
    home = _cache_home(monkeypatch, tmp_path)
    planted = home / "reward-lens" / "templates"
    planted.mkdir(parents=True)
    (home / "reward-lens").chmod(0o700)
    planted.chmod(0o777)  # as if another user could write pickles into it
    (planted / "__reward_lens_text_planted.cache").write_bytes(b"not a template")
    assert spec_render.cache_directory() is None
    planted.chmod(0o700)
    assert spec_render.cache_directory() == planted
    # a cache root that others can write into is refused whole
    home.chmod(0o777)
    assert spec_render.cache_directory() is None
    home.chmod(0o700)


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="only root can make a directory another user's (CI runs as root)")
def test_a_directory_another_user_owns_is_never_loaded_from(monkeypatch, tmp_path):
    home = _cache_home(monkeypatch, tmp_path)
    planted = home / "reward-lens" / "templates"
    planted.mkdir(parents=True)
    (home / "reward-lens").chmod(0o700)
    planted.chmod(0o700)
    assert spec_render.cache_directory() == planted
    os.chown(planted, 65534, 65534)
    assert spec_render.cache_directory() is None
    os.chown(planted, os.getuid(), os.getgid())
    assert spec_render.cache_directory() == planted


def test_a_string_template_is_cached_by_its_text_and_compiled_again_when_edited(tmp_path, monkeypatch):
    """The findings' templates are strings in their specs (``spec_render.from_string``): kept in the
    same cache, keyed by their text, and never served for another text."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = _env(tmp_path, cache, "prose", False)
    assert spec_render.from_string(env, "a {{ v }}").render(v=1) == "a 1"
    assert len(os.listdir(cache)) == 1
    compiled = []
    fresh = _env(tmp_path, cache, "prose", False)
    monkeypatch.setattr(fresh, "compile", lambda *a, **k: compiled.append(a) or jinja2.Environment.compile(fresh, *a, **k))
    assert spec_render.from_string(fresh, "a {{ v }}").render(v=2) == "a 2" and not compiled  # loaded, not compiled
    assert spec_render.from_string(fresh, "b {{ v }}").render(v=2) == "b 2" and len(compiled) == 1
    assert len(os.listdir(cache)) == 2
    # without a cache, or with one that cannot be written, it is Jinja's own from_string
    plain = jinja2.Environment()
    assert spec_render.from_string(plain, "c {{ v }}").render(v=3) == "c 3"
    assert spec_render.from_string(_env(tmp_path, tmp_path / "nowhere", "prose", False), "d {{ v }}").render(v=4) == "d 4"
