"""The declarative layer of reward-lens.

Loads the YAML specs (``specs/``), resolves which record fields satisfy which book, builds
typed refusals and renders their detail and remedy from Jinja2 templates (``templates/``).
It knows nothing of ``reward_lens``: the instruments use it, never the reverse.
"""

from reward_lens_spec.errors import SpecError
from reward_lens_spec.loader import (
    load_book,
    load_books,
    load_fields,
    load_findings,
    load_frameworks,
    load_importers,
    load_refusal_codes,
    load_taps,
)
from reward_lens_spec.refusal import Refusal, Subject, make_refusal
from reward_lens_spec.resolver import Presence, Resolution, resolve

__all__ = [
    "Presence",
    "Refusal",
    "Resolution",
    "SpecError",
    "Subject",
    "load_book",
    "load_books",
    "load_fields",
    "load_findings",
    "load_frameworks",
    "load_importers",
    "load_refusal_codes",
    "load_taps",
    "make_refusal",
    "resolve",
]
