"""Figures as data: what a book wants drawn, with units, for the report to render.

A book describes its figures (panels of series, each a line, a band, points or intervals);
``reward_lens.report.plots`` draws any of them, so the report holds no book-specific plotting
code. Long series are reduced there to at most ``MAX_POINTS`` per line (min and max per bin),
so a plot costs O(width), not O(steps).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Series(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str | None = None
    x: list[float]
    y: list[float]
    # "line" (broken at gaps in x by ``gaps``), "dashed", "points", "hollow" (unfilled points),
    # "band" (fill between lo and hi), "interval" (vertical bars lo..hi), "stack" (stacked area)
    style: Literal["line", "dashed", "points", "hollow", "band", "interval", "stack"] = "line"
    lo: list[float] | None = None
    hi: list[float] | None = None
    color: str | None = None
    gaps: list[float] = Field(default_factory=list, description="x values after which a line is broken")


class Panel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str | None = None
    y_label: str
    log_y: bool = False
    zero_line: bool = False
    series: list[Series]
    v_lines: list[tuple[float, str]] = Field(default_factory=list, description="reference x values, labelled")


class FigureOut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    caption: str
    x_label: str
    panels: list[Panel]
    columns: int = 1
