"""Refusals: typed return values that say what is missing and what to do about it.

A Refusal carries structured data (code, book, subject, context). Its ``detail`` (what is
wrong, where) and ``remedy`` (what to do) are rendered late from
``templates/refusals/<CODE>/<template>.{detail,remedy}.j2`` with that context; the text,
Markdown, HTML and JSON forms are views of the same data.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from reward_lens_spec.errors import SpecError
from reward_lens_spec.loader import load_refusal_codes
from reward_lens_spec.models import BookSpec
from reward_lens_spec.render import html_view, markdown_view, render_template, text_view


class Subject(BaseModel):
    model_config = ConfigDict(frozen=True)

    run_id: str | None = None
    step_pairs: tuple[tuple[int, int], ...] = Field(default=(), description="(t, t+1) pairs the refusal covers")


class Refusal(BaseModel):
    model_config = ConfigDict(frozen=True)

    code: str
    book: str
    function: str
    subject: Subject
    context: dict[str, Any]
    detail: str
    remedy: str

    @property
    def severity(self) -> str:
        return load_refusal_codes().codes[self.code].severity

    def text(self, width: int = 90) -> str:
        """The seed's layout: ``function  CODE``, indented detail, a ``Remedy:`` paragraph."""
        return "\n".join([
            f"{self.function}  {self.code}",
            text_view(self.detail, width=width),
            text_view(self.remedy, width=width, lead="Remedy: "),
        ])

    def markdown(self) -> str:
        return f"**{self.code}** — {markdown_view(self.detail)}\n\n**Remedy.** {markdown_view(self.remedy)}"

    def html(self) -> str:
        return (f'<div class="refusal" id="refusal-{self.book}-{self.code.lower()}">'
                f"<h4>{self.code}</h4>{html_view(self.detail)}"
                f'<div class="remedy"><strong>Remedy.</strong>{html_view(self.remedy)}</div></div>')

    def __str__(self) -> str:
        return self.text()


def make_refusal(code: str, book: BookSpec, subject: Subject, context: dict[str, Any]) -> Refusal:
    """Build a refusal of ``code`` for ``book``, rendering its detail and remedy templates."""
    catalogue = load_refusal_codes()
    if code not in catalogue.codes:
        raise SpecError(f"refusal code `{code}` is not defined in specs/refusal_codes.yaml")
    if code not in book.refusals:
        raise SpecError(f"book `{book.id}` does not declare refusal `{code}` in specs/books/{book.id}.yaml")
    template = book.refusals[code]
    ctx = {"book": book, "subject": subject, "code": code, **context}
    detail = render_template(f"refusals/{code}/{template}.detail.j2", ctx)
    remedy = render_template(f"refusals/{code}/{template}.remedy.j2", ctx)
    return Refusal(code=code, book=book.id, function=book.function, subject=subject,
                   context=_jsonable(context), detail=detail, remedy=remedy)


def _jsonable(value: Any) -> Any:
    """``value`` as JSON types, a copy: dict keys as strings, tuples as lists, numpy scalars as
    Python numbers, anything else as its ``str``. A refusal may name 10,000 step pairs, each a
    dict of plain numbers: those are copied as they are (a walk that only checks types, 4x
    faster than a round trip through the C encoder); anything else goes through the encoder and
    back (``_encoded``). A bool or None key comes out as JSON spells it ("true", "null")."""
    t = type(value)
    if t is dict:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                return _encoded(value)
            tv = type(v)
            out[k] = v if tv in _PLAIN else _jsonable(v)
        return out
    if t is list or t is tuple:
        return [v if type(v) in _PLAIN else _jsonable(v) for v in value]
    if t in _PLAIN:
        return value
    return _encoded(value)


def _encoded(value: Any) -> Any:
    """Through the C encoder and back; by hand where the encoder cannot take it (a key that is
    not a string, number, bool or None)."""
    try:
        return json.loads(json.dumps(value, default=_scalar))
    except (TypeError, ValueError):
        return _jsonable_slow(value)


_PLAIN = frozenset({str, int, float, bool, type(None)})


def _scalar(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


def _jsonable_slow(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable_slow(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable_slow(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)
