"""The report's axes for curves of tiny values: a one-step GRPO stage logs one `kl` of about 3e-14 (the policy has
barely moved off its reference), and the y ticks, rounded to 12 decimals, all became 0, so writing the report
divided by zero and the run ended without report.md."""

from __future__ import annotations

from kitcli.display import svgplot


def test_ticks_of_values_below_1e_12_span_them():
    ticks = svgplot.nice_ticks(3.02e-14, 3.02e-14)
    assert ticks[0] < 3.02e-14 < ticks[-1], ticks
    assert len(set(ticks)) == len(ticks) >= 3, ticks


def test_a_panel_of_one_tiny_value_is_drawn():
    figure = svgplot.line_figure("stage 1: grpo (grpo)", [svgplot.Panel("KL to the reference", "KL",
                                                                        [svgplot.Series("kl", [1.0], [3.02e-14])])])
    assert 'data-y="3.02e-14"' in figure
