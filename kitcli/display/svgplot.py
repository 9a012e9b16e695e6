"""The run report's figures as SVG text: panels of line plots (a stage's curves) and grouped bars (the evaluations).

Written directly rather than through matplotlib, whose import alone takes about half a second on a CPU and whose
layout and PNG encoding about as much again: that was most of a short run's fixed cost over a hand-written TRL
script (bench/overhead.py). The figures are simple (a few series, tens to thousands of points), SVG scales in any
browser, on GitHub and in editors, and each series carries its data as `data-x` / `data-y` attributes, so the
figure can be checked against the metrics it was drawn from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")  # matplotlib's tab10
PANEL_W, PANEL_H = 520, 340
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 20, 34, 48
TITLE_H = 36


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series]


def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 2.5 or 5 times a power of ten apart)."""
    if hi <= lo:
        lo, hi = lo - (abs(lo) * 0.1 or 1.0), hi + (abs(hi) * 0.1 or 1.0)
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    if integer:
        step = max(1.0, round(step))
    start = math.floor(lo / step) * step
    digits = 3 - math.floor(math.log10(step))  # enough for 2.5 x 10^k; a fixed 12 made ticks below 1e-12 all 0
    ticks, value = [], start
    while value <= hi + step * 1e-9:
        ticks.append(round(value, digits))
        value += step
    if ticks[-1] < hi:
        ticks.append(round(value, digits))
    return ticks


def tick_label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:.4g}"


def text(x: float, y: float, content: str, size: int = 12, anchor: str = "middle", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
            f'{escape(content)}</text>')


def numbers(values: list[float]) -> str:
    return ",".join(f"{v:.6g}" for v in values)


def axes(width: float, height: float, xticks: list[float], yticks: list[float], sx, sy,
         xlabels: list[str]) -> list[str]:
    """A frame, horizontal grid lines with y tick labels, and vertical ones with the x labels."""
    parts = [f'<rect x="0" y="0" width="{width:.1f}" height="{height:.1f}" fill="none" stroke="#444"/>']
    for value in yticks:
        y = sy(value)
        parts += [f'<line x1="0" x2="{width:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#000" stroke-opacity="0.12"/>',
                  text(-6, y + 4, tick_label(value), 11, "end")]
    for value, label in zip(xticks, xlabels):
        x = sx(value)
        parts += [f'<line x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{height:.1f}" stroke="#000" stroke-opacity="0.12"/>',
                  text(x, height + 16, label, 11)]
    return parts


def line_panel(panel: Panel) -> list[str]:
    """One panel's SVG elements, drawn in a PANEL_W x PANEL_H box at the origin."""
    width, height = PANEL_W - MARGIN_LEFT - MARGIN_RIGHT, PANEL_H - MARGIN_TOP - MARGIN_BOTTOM
    xs = [x for s in panel.series for x in s.xs]
    ys = [y for s in panel.series for y in s.ys if math.isfinite(y)]
    if not xs or not ys:
        return [text(PANEL_W / 2, PANEL_H / 2, f"{panel.title}: nothing logged")]
    xticks = nice_ticks(min(xs), max(xs), 6, integer=True)
    yticks = nice_ticks(min(ys), max(ys), 5)

    def sx(v: float) -> float:
        return (v - xticks[0]) / (xticks[-1] - xticks[0]) * width

    def sy(v: float) -> float:
        return height - (v - yticks[0]) / (yticks[-1] - yticks[0]) * height

    parts = [f'<g transform="translate({MARGIN_LEFT},{MARGIN_TOP})" class="panel" data-title="{escape(panel.title)}">']
    parts += axes(width, height, xticks, yticks, sx, sy, [tick_label(v) for v in xticks])
    for index, series in enumerate(panel.series):
        color = COLORS[index % len(COLORS)]
        points = [(sx(x), sy(y)) for x, y in zip(series.xs, series.ys) if math.isfinite(y)]
        parts.append(f'<polyline class="series" data-label="{escape(series.label)}" data-x="{numbers(series.xs)}" '
                     f'data-y="{numbers(series.ys)}" fill="none" stroke="{color}" stroke-width="1.5" '
                     f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}"/>')
        if len(points) <= 30:
            parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in points]
    if len(panel.series) > 1:
        left = width - 34 - 6.4 * max(len(s.label) for s in panel.series)  # about 6.4 px a character at 11 px
        parts.append(f'<rect x="{left - 4:.1f}" y="3" width="{width - left:.1f}" height="{16 * len(panel.series) + 4}" '
                     f'fill="white" fill-opacity="0.8"/>')
        for index, series in enumerate(panel.series):
            y = 14 + 16 * index
            parts += [f'<line x1="{left:.1f}" x2="{left + 20:.1f}" y1="{y - 4}" y2="{y - 4}" '
                      f'stroke="{COLORS[index % len(COLORS)]}" stroke-width="2"/>',
                      text(left + 25, y, series.label, 11, "start")]
    parts += [text(width / 2, -10, panel.title, 13), text(width / 2, height + 36, "step", 12),
              text(-52, height / 2, panel.ylabel, 12, extra=f' transform="rotate(-90 -52 {height / 2:.1f})"'),
              "</g>"]
    return parts


def document(width: float, height: float, title: str, body: list[str]) -> str:
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
                      f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans, Arial, sans-serif">',
                      '<rect width="100%" height="100%" fill="white"/>',
                      f'<title>{escape(title)}</title>', text(width / 2, 24, title, 15, extra=' class="title"'),
                      *body, "</svg>", ""])


def line_figure(title: str, panels: list[Panel]) -> str:
    """Panels in a grid (1, 2 or 3 columns) under a title."""
    columns = 1 if len(panels) == 1 else 2 if len(panels) <= 4 else 3
    rows = math.ceil(len(panels) / columns)
    body = []
    for index, panel in enumerate(panels):
        x, y = (index % columns) * PANEL_W, TITLE_H + (index // columns) * PANEL_H
        body += [f'<g transform="translate({x},{y})">', *line_panel(panel), "</g>"]
    return document(columns * PANEL_W, TITLE_H + rows * PANEL_H, title, body)


def bar_figure(title: str, groups: list[str], series: list[Series], xlabel: str, ylabel: str) -> str:
    """Grouped bars: one group per entry of `groups`, one bar per series (its ys, one value per group)."""
    width = max(600.0, 160 * len(groups) * max(1, len(series)) ** 0.5 + 200) - MARGIN_LEFT - MARGIN_RIGHT
    height = 300.0
    values = [v for s in series for v in s.ys]
    yticks = nice_ticks(min(0.0, *values), max(0.0, *values) * 1.1 or 1.0, 5)

    def sy(v: float) -> float:
        return height - (v - yticks[0]) / (yticks[-1] - yticks[0]) * height

    def sx(position: float) -> float:
        return (position + 0.5) / len(groups) * width

    bar = 0.8 / len(series)
    body = [f'<g transform="translate({MARGIN_LEFT},{TITLE_H + MARGIN_TOP})" class="panel" '
            f'data-title="{escape(title)}">']
    body += axes(width, height, [], yticks, sx, sy, [])
    for i, group in enumerate(groups):
        for line, label in enumerate(group.split("\n")):
            body.append(text(sx(i), height + 16 + 14 * line, label, 11))
    for index, s in enumerate(series):
        color = COLORS[index % len(COLORS)]
        body.append(f'<g class="series" data-label="{escape(s.label)}" data-y="{numbers(s.ys)}">')
        offset = (index - (len(series) - 1) / 2) * bar  # this series' bar centre, in groups from the group's
        for i, value in enumerate(s.ys):
            x0, x1 = sx(i + offset - bar / 2), sx(i + offset + bar / 2)
            top, base = sy(max(value, 0.0)), sy(min(value, 0.0))
            body += [f'<rect x="{x0:.1f}" y="{top:.1f}" width="{x1 - x0:.1f}" height="{base - top:.1f}" '
                     f'fill="{color}"/>', text((x0 + x1) / 2, top - 4, f"{value:.3f}", 10)]
        body.append("</g>")
        body += [f'<rect x="{width - 160}" y="{6 + 16 * index}" width="12" height="10" fill="{color}"/>',
                 text(width - 143, 15 + 16 * index, s.label, 11, "start")]
    body += [text(width / 2, height + 48, xlabel, 12),
             text(-52, height / 2, ylabel, 12, extra=f' transform="rotate(-90 -52 {height / 2:.1f})"'), "</g>"]
    return document(width + MARGIN_LEFT + MARGIN_RIGHT, TITLE_H + MARGIN_TOP + height + 64, title, body)
