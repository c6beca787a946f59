"""Template rendering and the text / Markdown / HTML views of rendered prose.

Templates and specs write prose in a light Markdown: paragraphs separated by a blank line,
code in backticks, **strong**, *emphasis* and links to anchors of the same page. The plain-text
view wraps paragraphs; the Markdown view keeps them as they are; the HTML view escapes
everything first and only then turns that Markdown into tags, so text that came from a record
can never become markup, and no Markdown reaches a reader as literal characters.
"""

from __future__ import annotations

import html
import os
import re
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

from reward_lens_spec.errors import SpecError
from reward_lens_spec.paths import templates_dir


class _CompiledTemplates(jinja2.FileSystemBytecodeCache):
    """Jinja's own cache of compiled templates, kept only in a directory no other user can
    write (``cache_directory()``: the user's cache directory, never the shared temp directory,
    where Jinja's default ``_jinja2-cache-<uid>`` can be pre-created by another user). Entries
    are keyed by the template's path and checked against its source's hash, written by rename.
    ``tag`` keeps environments whose options change the compiled code apart (autoescape,
    whitespace control), and the Jinja version keeps releases apart. A cache that cannot be
    read or written is passed over: it only saves compiling (about 0.2 s a report)."""

    def __init__(self, tag: str, directory: str | None = None):
        super().__init__(directory=directory or os.devnull,
                         pattern=f"__reward_lens_{tag}_{jinja2.__version__}_%s.cache")

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # unreadable or cut short (Jinja reads its header with pickle): compile instead
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


def _private_dir(path: Path) -> bool:
    """True when ``path`` is a real directory (not a symlink) owned by this user that no one
    else can write: checked with lstat, after creating it 0700 where missing, never chmod-ed
    (chmod follows symlinks)."""
    import stat

    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode)
            and st.st_uid == os.getuid() and not st.st_mode & 0o077)


def cache_directory() -> Path | None:
    """Where compiled templates may be kept: ``$XDG_CACHE_HOME/reward-lens/templates`` (or
    ``~/.cache/...``) when it and its parent are this user's private directories, else None."""
    if not hasattr(os, "getuid"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):
        return None
    try:
        if os.stat(base).st_mode & 0o022:  # a cache root others can write into is not private
            return None
    except OSError:
        pass  # created below, 0700
    parent = Path(base) / "reward-lens"
    path = parent / "templates"
    return path if _private_dir(parent) and _private_dir(path) else None


def compiled_templates(tag: str) -> jinja2.BytecodeCache | None:
    """The bytecode cache for an environment (None when REWARD_LENS_TEMPLATE_CACHE=0, or when
    no private per-user directory can be had: then templates are compiled each time)."""
    if os.environ.get("REWARD_LENS_TEMPLATE_CACHE", "1") == "0":
        return None
    where = cache_directory()
    return _CompiledTemplates(tag, str(where)) if where is not None else None


def from_string(env: jinja2.Environment, text: str) -> jinja2.Template:
    """``env.from_string(text)``, its compiled code kept in ``env``'s bytecode cache as a
    template file's is (Jinja's own ``from_string`` never reads or writes it): keyed by the
    text's hash, checked against the text itself, so an edited spec compiles again. Compiling
    the findings' templates was a seventh of a second of every report."""
    import hashlib

    cache = env.bytecode_cache
    if cache is None:
        return env.from_string(text)
    name = "<string " + hashlib.sha256(text.encode("utf-8")).hexdigest() + ">"
    try:
        bucket = cache.get_bucket(env, name, None, text)
    except Exception:  # an unusable cache is passed over, as for template files
        return env.from_string(text)
    code = bucket.code
    if code is None:
        code = env.compile(text, name)
        bucket.code = code
        try:
            cache.set_bucket(bucket)
        except Exception:
            pass
    return env.template_class.from_code(env, code, env.make_globals(None), None)


@lru_cache(maxsize=None)
def _env(root: str) -> jinja2.Environment:
    env = jinja2.Environment(
        bytecode_cache=compiled_templates("prose"),
        loader=jinja2.FileSystemLoader(root),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        autoescape=False,  # prose is escaped per view (html_view), never half-escaped here
    )
    env.filters["nats"] = format_nats
    env.filters["plural"] = lambda n, one="", many="s": one if n == 1 else many
    env.filters["abs"] = abs
    env.filters["capitalize_first"] = lambda s: s[:1].upper() + s[1:]
    env.filters["in_sentence"] = in_sentence
    env.filters["join_code"] = lambda xs: ", ".join(f"`{x}`" for x in xs)
    env.filters["num3"] = format_nats
    env.filters["pct"] = percent
    env.filters["codes"] = code_list
    return env


def in_sentence(title: str) -> str:
    """A title inside a sentence: its first letter lower-cased, unless its first word is an
    abbreviation ("KL spikes" stays, "Reward plateau" becomes "reward plateau")."""
    first = title.split(" ", 1)[0]
    return title if first[1:2].isupper() else title[:1].lower() + title[1:]


def percent(x: float | None) -> str:
    """A fraction as a whole percentage ("78 %"): the one way a share or an efficiency is
    written in prose."""
    return "—" if x is None else f"{round(100 * x)} %"


def code_list(names) -> str:
    """Names as code spans in a sentence: `a`, `b` and `c`."""
    names = [f"`{n}`" for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def format_nats(x: float) -> str:
    """Numbers in prose: 3 significant figures, scientific outside [1e-3, 1e4)."""
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    ax = abs(x)
    if ax != 0 and (ax < 1e-3 or ax >= 1e4):
        return f"{x:.2e}"
    return f"{x:.3g}"


def render_template(name: str, context: dict[str, Any], root: Path | None = None, *, prose: bool = True) -> str:
    """``name`` rendered; as prose (paragraphs, lines joined) unless ``prose=False`` (a table)."""
    env = _env(str(root or templates_dir()))
    try:
        template = env.get_template(name)
        text = template.render(**context)
    except jinja2.TemplateNotFound:
        raise SpecError(f"{(root or templates_dir()) / name}:1: template not found") from None
    except jinja2.UndefinedError as exc:
        raise SpecError(f"{(root or templates_dir()) / name}:1: {exc.message} (missing from the refusal context)") from None
    except jinja2.TemplateSyntaxError as exc:
        raise SpecError(f"{exc.filename}:{exc.lineno}: {exc.message}") from None
    return normalise_prose(text) if prose else text.strip() + "\n"


def render_macro(name: str, macro: str, root: Path | None = None, **kwargs: Any) -> str:
    """One macro of a template of sentences (e.g. ``templates/audit/says.j2``), rendered."""
    env = _env(str(root or templates_dir()))
    try:
        module = env.get_template(name).module
    except jinja2.TemplateNotFound:
        raise SpecError(f"{(root or templates_dir()) / name}:1: template not found") from None
    if not hasattr(module, macro):
        raise SpecError(f"{(root or templates_dir()) / name}:1: no macro `{macro}`")
    return " ".join(str(getattr(module, macro)(**kwargs)).split())


def normalise_prose(text: str) -> str:
    """Collapse whitespace inside paragraphs; keep blank lines between paragraphs."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip())]
    return "\n\n".join(p for p in paras if p)


def paragraphs(text: str) -> list[str]:
    return [p for p in text.split("\n\n") if p]


def text_view(text: str, width: int = 90, indent: str = "    ", lead: str = "") -> str:
    out = []
    for i, para in enumerate(paragraphs(text)):
        first = indent + (lead if i == 0 else "")
        out.append(textwrap.fill(para, width=width, initial_indent=first, subsequent_indent=indent,
                                 break_long_words=False, break_on_hyphens=False))
    return "\n".join(out)


_CODE_SPAN = re.compile(r"(`[^`]+`)")
# A link to a place on the same page, [words](#anchor): the only link prose may carry.
_ANCHOR = re.compile(r"\[([^\]`]+)\]\(#([a-z0-9-]+)\)")
_STRONG = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")
_EM = re.compile(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])")


def inline_html(text: str) -> str:
    """One paragraph of prose's light Markdown as HTML, everything escaped first: code spans
    (nothing inside one is markup), **strong**, *emphasis* and [words](#anchor) links to the same
    page. Underscores are never emphasis (``KL_min``, ``D_t``). Strong, emphasis and links may
    hold code spans (``**your target `x` fell**``): the spans are set aside as placeholders while
    the rest is marked up, then put back."""
    spans: list[str] = []

    def aside(m: re.Match) -> str:
        spans.append(f"<code>{html.escape(m.group(1)[1:-1], quote=True)}</code>")
        return f"\x00{len(spans) - 1}\x00"

    e = html.escape(_CODE_SPAN.sub(aside, text.replace("\x00", "")), quote=True)
    e = _STRONG.sub(r"<strong>\1</strong>", e)
    e = _EM.sub(r"<em>\1</em>", e)
    e = _ANCHOR.sub(lambda m: f'<a href="#{m.group(2)}">{m.group(1)}</a>', e)
    return re.sub("\x00(\\d+)\x00", lambda m: spans[int(m.group(1))], e)


def html_view(text: str) -> str:
    """Prose as HTML paragraphs, each ``inline_html``."""
    return "\n".join("<p>" + inline_html(para) + "</p>" for para in paragraphs(text))


def markdown_view(text: str) -> str:
    # Backticks already mean code in Markdown; '<' would open raw HTML in most renderers.
    return "\n\n".join(p.replace("<", "&lt;") for p in paragraphs(text))


_ABBREV = ("e.g.", "i.e.", "etc.", "vs.", "cf.")


def first_sentence(text: str) -> str:
    """The first sentence of rendered prose: up to the first '.', '!' or '?' outside a
    backtick code span that ends a word and is followed by a space (abbreviations kept)."""
    para = paragraphs(text)[0] if text else ""
    in_code = False
    for i, ch in enumerate(para):
        if ch == "`":
            in_code = not in_code
        elif ch in ".!?" and not in_code and (i + 1 == len(para) or para[i + 1] == " "):
            if any(para[: i + 1].endswith(a) for a in _ABBREV):
                continue
            return para[: i + 1]
    return para
