"""Render a Report as Markdown, single-file HTML and JSON (views of the same data)."""

from __future__ import annotations

import html
import json
import re
from functools import lru_cache

import jinja2
from markupsafe import Markup

from reward_lens.report import plots
from reward_lens.report.model import Report
from reward_lens_spec.paths import templates_dir
from reward_lens_spec.render import html_view, markdown_view

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def visible(text: str) -> str:
    """Control characters as ``\\xNN`` (a NUL or escape byte is not text a page can show)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def md_cell(text: str, limit: int = 80) -> str:
    """Record text made safe for one GFM table cell: nothing it contains can end the cell,
    open a tag, start a code span or emphasis, or break the row."""
    text = visible(text)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    text = text.replace("\n", "⏎").replace("\r", "⏎")
    text = html.escape(text, quote=False)  # < > & as entities: no raw HTML
    return _MD_SPECIAL.sub(r"\\\1", text)


def fmt(x, digits: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    ax = abs(x)
    return f"{x:.{digits - 1}e}" if ax < 1e-3 or ax >= 1e5 else f"{x:.{digits}g}"


@lru_cache(maxsize=None)
def environment(root: str, autoescape: bool) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(root), undefined=jinja2.StrictUndefined,
                             autoescape=autoescape, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(md_cell=md_cell, fmt=fmt, prose_md=markdown_view, visible=visible,
                       prose_html=lambda t: Markup(html_view(t)))
    return env


def to_markdown(report: Report) -> str:
    return environment(str(templates_dir()), False).get_template("report/report.md.j2").render(r=report)


def to_json(report: Report) -> str:
    return json.dumps(report.model_dump(mode="json"), indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def figures(report: Report) -> dict[str, dict[str, Markup | None]]:
    out: dict[str, dict[str, Markup | None]] = {}
    for book in report.books:
        c = book.cost
        if c is None:
            continue
        figs: dict[str, str | None] = dict.fromkeys(("kl_min", "shares", "efficiency", "means"))
        if c.kl_min:
            figs["kl_min"] = plots.kl_min_plot(c)
            figs["shares"] = plots.shares_plot(c)
        if c.efficiency:
            figs["efficiency"] = plots.efficiency_plot(c)
        if c.feature_means:
            figs["means"] = plots.feature_means_plot(c)
        out[book.id] = {k: Markup(v) if v else None for k, v in figs.items()}
    return out


def to_html(report: Report) -> str:
    return environment(str(templates_dir()), True).get_template("report/report.html.j2").render(r=report, figs=figures(report))
