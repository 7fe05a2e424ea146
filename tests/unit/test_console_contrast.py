"""Every badge and label of the console's stylesheet that sets both a text colour and a
background has the contrast WCAG AA asks of normal text (4.5:1)."""

from __future__ import annotations

import re
from pathlib import Path

CSS = Path(__file__).resolve().parents[2] / "console" / "static" / "console.css"


def _luminance(hex_colour: str) -> float:
    h = hex_colour.lstrip("#")
    if len(h) == 3:
        h = "".join(c * 2 for c in h)
    channels = [int(h[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: str, b: str) -> float:
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def test_the_contrast_formula_matches_known_pairs() -> None:
    assert round(contrast("#000", "#fff"), 1) == 21.0
    assert round(contrast("#fb923c", "#fff"), 1) == 2.3  # the old "recovered" badge


def test_every_rule_with_a_colour_on_a_background_reaches_4_5_to_1() -> None:
    rules = re.findall(r"([^{}]+)\{([^}]*)\}", CSS.read_text())
    checked = {}
    for selector, body in rules:
        bg = re.search(r"background:\s*(#[0-9a-fA-F]{3,6})\b", body)
        fg = re.search(r"(?<![-\w])color:\s*(#[0-9a-fA-F]{3,6})\b", body)
        if bg and fg:
            checked[selector.strip()] = contrast(bg.group(1), fg.group(1))
    for badge in (".badge.recovered", ".badge.warn", ".badge.live"):
        assert badge in checked, badge
    low = {sel: round(ratio, 2) for sel, ratio in checked.items() if ratio < 4.5}
    assert low == {}
