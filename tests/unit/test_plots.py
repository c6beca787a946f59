"""The SVG plotter: ticks worked by hand, well-formed and deterministic SVG, gaps, log scales,
escaping, and the reduction of long series."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from reward_lens.measure.figures import FigureOut, Panel, Series
from reward_lens.report.plots import MAX_POINTS, nice_ticks, render_figure, tick_label

SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize("lo, hi, ticks, decimals", [
    (0.0, 10.0, [0, 2, 4, 6, 8, 10], 0),          # span 10 / 5: step 2
    (-0.3, 0.7, [-0.2, 0, 0.2, 0.4, 0.6], 1),      # span 1 / 5 = 0.2
    (0.0, 1.0e-3, [0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3], 4),
    (3.0, 4.0, [3.0, 3.2, 3.4, 3.6, 3.8, 4.0], 1),
    (0.0, 9.0, [0, 2, 4, 6, 8], 0),                # 9 / 2 = 4.5 intervals <= 5: the step is 2
])
def test_nice_ticks_by_hand(lo, hi, ticks, decimals):
    got, dec = nice_ticks(lo, hi)
    assert np.allclose(got, ticks) and dec == decimals
    assert tick_label(0.2 * 3, 1) == "0.6" and tick_label(0.0, 3) == "0" and tick_label(250000.0, 0) == "2.5e5"


def test_a_step_of_two_and_a_half_shows_one_more_decimal():
    got, dec = nice_ticks(0.0, 11.0)  # 11 / 2 = 5.5 intervals > 5, 11 / 2.5 = 4.4: step 2.5
    assert np.allclose(got, [0, 2.5, 5, 7.5, 10]) and dec == 1


def _figure(**panel) -> FigureOut:
    base = dict(y_label="y <units>", series=[Series(label="a & b", x=[0, 1, 2, 4, 5], y=[1, 2, 3, 4, 5],
                                                    gaps=[2.0])])
    return FigureOut(id="f1", caption='cap "quoted"', x_label="step", panels=[Panel(**{**base, **panel})])


def test_svg_is_well_formed_deterministic_and_escaped():
    svg = render_figure(_figure(title="<script>x</script>"))
    root = ET.fromstring(svg)  # parses: every label was escaped
    assert root.tag == SVG_NS + "svg" and root.get("aria-label") == 'cap "quoted"'
    texts = [t.text for t in root.iter(SVG_NS + "text")]
    assert "<script>x</script>" in texts and "y <units>" in texts and "a & b" in texts
    assert render_figure(_figure(title="<script>x</script>")) == svg
    # ids are the figure's own, so two figures can share a page
    assert all(i.startswith("f1-") for i in re.findall(r'id="([^"]+)"', svg))


def test_a_line_is_broken_at_a_gap_and_points_beyond_the_axes_are_clipped():
    svg = render_figure(_figure())
    (line,) = [p for p in ET.fromstring(svg).iter(SVG_NS + "path") if p.get("stroke-width") == "1.1"]
    d = line.get("d")
    assert d.count("M") == 2  # 0,1,2 then 4,5: never joined across the gap
    xs = [float(v.split(",")[0]) for v in re.findall(r"[-\d.]+,[-\d.]+", d)]
    assert xs == sorted(xs) and len(xs) == 5


def test_log_axis_draws_positive_values_only_with_decade_ticks():
    fig = _figure(log_y=True, series=[Series(x=[0, 1, 2, 3], y=[1e-3, 0.0, 1e-1, 1.0])])
    root = ET.fromstring(render_figure(fig))
    texts = [t.text for t in root.iter(SVG_NS + "text")]
    assert {"10⁻³", "10⁻²", "10⁻¹", "10⁰"} <= set(texts)
    (line,) = [p for p in root.iter(SVG_NS + "path") if p.get("stroke-width") == "1.1"]
    assert line.get("d").count("M") == 2  # the zero breaks the line


def test_long_series_of_every_style_are_drawn_in_bounded_size():
    n = 50_000
    x = np.arange(n, dtype=float)
    y = np.sin(x / 300)
    series = [Series(x=x.tolist(), y=y.tolist(), style=s, lo=(y - 1).tolist(), hi=(y + 1).tolist())
              for s in ("line", "points", "hollow", "band", "interval")]
    series += [Series(label=f"s{i}", x=x.tolist(), y=np.abs(y).tolist(), style="stack") for i in range(2)]
    svg = render_figure(FigureOut(id="big", caption="c", x_label="x", panels=[Panel(y_label="y", series=series)]))
    root = ET.fromstring(svg)
    for p in root.iter(SVG_NS + "path"):
        d = p.get("d")
        assert d.count("M") <= MAX_POINTS + 1  # a dot or an interval is one move; a line or area a few
        if "a" not in d:  # not dots: every vertex is a coordinate pair
            assert len(re.findall(r"[-\d.]+,[-\d.]+", d)) <= 2 * MAX_POINTS + 2
    assert len(svg) < 1_000_000


def test_a_panel_draws_a_min_and_a_max_per_pixel_column_and_keeps_every_spike():
    """In a grid of three columns a panel is ~170 px wide: a 50,000-point line is drawn with at
    most two points per pixel column, and a one-point spike is among them."""
    from reward_lens.report.plots import GAP_COLS, MARGIN_LEFT, MARGIN_RIGHT, WIDTH, points_for

    n = 50_000
    rng = np.random.default_rng(2)
    y = rng.normal(size=n) * 0.1
    y[31_337] = 25.0  # one spike
    panels = [Panel(y_label="y", series=[Series(x=np.arange(n, dtype=float).tolist(), y=y.tolist())])
              for _ in range(3)]
    svg = render_figure(FigureOut(id="grid", caption="c", x_label="x", columns=3, panels=panels))
    axes_w = (WIDTH - MARGIN_LEFT - MARGIN_RIGHT - GAP_COLS * 2) / 3
    assert points_for(axes_w) == 2 * math.ceil(axes_w) < MAX_POINTS
    root = ET.fromstring(svg)
    lines = [p.get("d") for p in root.iter(SVG_NS + "path") if p.get("stroke-width") == "1.1"]
    assert len(lines) == 3
    for d in lines:
        pts = [tuple(map(float, m)) for m in re.findall(r"([-\d.]+),([-\d.]+)", d)]
        assert len(pts) <= points_for(axes_w)
        ys = sorted(py for _, py in pts)  # SVG y grows downwards: the spike is the one point far above the rest
        assert ys[1] - ys[0] > 0.9 * (ys[-1] - ys[0])


def _reduce_by_sorting(x, y, max_points=MAX_POINTS):
    """reduce_minmax as a stable sort by bin, then y, writes it: each bin's first and last point."""
    from reward_lens.report.plots import _bin_of

    b = _bin_of(len(x), max_points)
    finite = np.isfinite(y)
    idx = np.nonzero(finite)[0]
    order = idx[np.lexsort((y[idx], b[idx]))]
    sb = b[order]
    keep = np.union1d(order[np.r_[True, sb[1:] != sb[:-1]]], order[np.r_[sb[1:] != sb[:-1], True]])
    keep = np.union1d(keep, np.nonzero(~finite)[0])
    return x[keep], y[keep]


def test_the_reduction_keeps_the_points_a_sort_by_bin_and_value_would():
    """Each bin's first point at its minimum and last at its maximum, ties (signed zeros too),
    breaks and infinities as a stable sort picks them; a line with no finite value keeps its
    breaks."""
    from reward_lens.report.plots import reduce_minmax

    rng = np.random.default_rng(3)
    for n in (2001, 9999, 30_000):
        x = np.arange(n, dtype=float)
        ties = rng.integers(-1, 2, size=n).astype(float)
        ties[ties == 0] = -0.0
        ties[::7] = 0.0
        holes = rng.normal(size=n)
        holes[rng.random(n) < 0.3] = np.nan
        holes[rng.random(n) < 0.05] = np.inf
        holes[rng.random(n) < 0.05] = -np.inf
        half = rng.normal(size=n)
        half[: n // 2] = np.nan
        for y in (rng.normal(size=n), ties, holes, half, np.full(n, 1.5)):
            for most in (MAX_POINTS, 600, 7):
                got, want = reduce_minmax(x, y, most), _reduce_by_sorting(x, y, most)
                assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1], equal_nan=True)
    gone = np.full(5000, np.nan)
    assert np.isnan(reduce_minmax(np.arange(5000.0), gone)[1]).all()


def test_coordinates_are_written_as_each_pair_would_be():
    from reward_lens.report.plots import _pairs

    rng = np.random.default_rng(4)
    for n in (0, 1, 3, 1300):
        for px, py in ((rng.uniform(-1e3, 1e3, n), rng.uniform(0, 300, n)), (-np.zeros(n), np.full(n, 0.05))):
            assert _pairs(px, py) == [f"{a:.1f},{b:.1f}" for a, b in zip(px.tolist(), py.tolist())]
