"""The overview's charts as tables, no services: the top of a scale, and a series' points as
runs of an SVG polyline, broken where no sample fell."""

from __future__ import annotations

import pytest

from worker.console.pages.overview import HEIGHT, WIDTH, chart, runs, scale_top


@pytest.mark.parametrize(
    ("values", "top"),
    [
        ([], 1.0),
        ([None, None], 1.0),
        ([0.0, 0.0], 1.0),
        ([0.3], 0.5),
        ([1.0], 1.0),
        ([1.2, None, 0.4], 2.0),
        ([3.0], 5.0),
        ([7.0], 10.0),
        ([140.0], 200.0),
        ([1_000.0, 999.0], 1_000.0),
    ],
)
def test_the_top_of_a_scale(values: list[float | None], top: float) -> None:
    assert scale_top(values) == pytest.approx(top)


@pytest.mark.parametrize(
    ("values", "top", "drawn"),
    [
        ([], 1.0, ()),
        ([None, None, None], 1.0, ()),
        # the whole width, the top at y=0 and 0 at the bottom
        ([0.0, 1.0], 1.0, (f"0.0,{HEIGHT:.1f} {WIDTH:.1f},0.0",)),
        # a gap breaks the line in two
        (
            [1.0, 1.0, None, 0.0, 0.0],
            1.0,
            ("0.0,0.0 150.0,0.0", f"450.0,{HEIGHT:.1f} 600.0,{HEIGHT:.1f}"),
        ),
        # a lone value is a short dash around it
        ([None, 0.5, None], 1.0, ("150.0,50.0 450.0,50.0",)),
        # beyond the top or below 0: at the edge
        ([2.0, -1.0], 1.0, (f"0.0,0.0 {WIDTH:.1f},{HEIGHT:.1f}",)),
    ],
)
def test_a_series_as_polyline_runs(
    values: list[float | None], top: float, drawn: tuple[str, ...]
) -> None:
    assert runs(values, top) == drawn


def test_a_chart_keeps_its_latest_value_and_its_colour() -> None:
    drawn = chart("Failures", [0.0, 2.5, None], bad=True)

    assert (drawn.latest, drawn.top, drawn.bad) == (2.5, 5.0, True)
    assert chart("Nothing", [None, None]).latest is None
