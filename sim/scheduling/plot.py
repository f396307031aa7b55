"""A PNG line chart in pure Python (zlib + struct): mean response time vs load, one line per policy.

routeledger adds no plotting dependency, so `sim schedule --plot` draws its own chart: axes with
tick marks and numbers, the region below the mean-response lower bound shaded (no policy can be
there), one polyline per policy in its own colour, and a legend of colour swatches with names.
Text comes from a 5x7 bitmap font of digits, lower-case letters and a little punctuation.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from itertools import pairwise

Color = tuple[int, int, int]

BACKGROUND: Color = (255, 255, 255)
AXIS: Color = (40, 40, 40)
SHADE: Color = (225, 225, 225)
# Distinct on white and from each other (Tableau 10 and a few more).
PALETTE: tuple[Color, ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (23, 190, 207),
    (188, 189, 34),
    (0, 0, 128),
    (128, 0, 0),
    (0, 100, 0),
)

# 5x7 glyphs, one string of 7 rows of 5 bits each ("1" = ink).
_GLYPHS: dict[str, str] = {
    "0": "01110 10001 10011 10101 11001 10001 01110",
    "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111",
    "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010",
    "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110",
    "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110",
    "9": "01110 10001 10001 01111 00001 00010 01100",
    "a": "00000 00000 01110 00001 01111 10001 01111",
    "b": "10000 10000 10110 11001 10001 10001 11110",
    "c": "00000 00000 01110 10000 10000 10001 01110",
    "d": "00001 00001 01101 10011 10001 10001 01111",
    "e": "00000 00000 01110 10001 11111 10000 01110",
    "f": "00110 01001 01000 11100 01000 01000 01000",
    "g": "00000 01111 10001 10001 01111 00001 01110",
    "h": "10000 10000 10110 11001 10001 10001 10001",
    "i": "00100 00000 01100 00100 00100 00100 01110",
    "j": "00010 00000 00110 00010 00010 10010 01100",
    "k": "10000 10000 10010 10100 11000 10100 10010",
    "l": "01100 00100 00100 00100 00100 00100 01110",
    "m": "00000 00000 11010 10101 10101 10001 10001",
    "n": "00000 00000 10110 11001 10001 10001 10001",
    "o": "00000 00000 01110 10001 10001 10001 01110",
    "p": "00000 00000 11110 10001 11110 10000 10000",
    "q": "00000 00000 01101 10011 01111 00001 00001",
    "r": "00000 00000 10110 11001 10000 10000 10000",
    "s": "00000 00000 01110 10000 01110 00001 11110",
    "t": "01000 01000 11100 01000 01000 01001 00110",
    "u": "00000 00000 10001 10001 10001 10011 01101",
    "v": "00000 00000 10001 10001 10001 01010 00100",
    "w": "00000 00000 10001 10001 10101 10101 01010",
    "x": "00000 00000 10001 01010 00100 01010 10001",
    "y": "00000 00000 10001 10001 01111 00001 01110",
    "z": "00000 00000 11111 00010 00100 01000 11111",
    "-": "00000 00000 00000 11111 00000 00000 00000",
    ".": "00000 00000 00000 00000 00000 01100 01100",
    ",": "00000 00000 00000 00000 01100 00100 01000",
    "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000",
    "=": "00000 00000 11111 00000 11111 00000 00000",
    ":": "00000 01100 01100 00000 01100 01100 00000",
    "/": "00001 00010 00010 00100 01000 01000 10000",
    " ": "00000 00000 00000 00000 00000 00000 00000",
    "?": "01110 10001 00001 00010 00100 00000 00100",
}
_FONT: dict[str, list[int]] = {c: [int(r, 2) for r in rows.split()] for c, rows in _GLYPHS.items()}
GLYPH_W, GLYPH_H = 6, 7  # advance (5 columns + 1 of space) and height


class Canvas:
    """An RGB raster with the few primitives a line chart needs."""

    def __init__(self, width: int, height: int, background: Color = BACKGROUND) -> None:
        self.width = width
        self.height = height
        self.rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * x
            self.rows[y][i : i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        i = 3 * x
        r, g, b = self.rows[y][i : i + 3]
        return (r, g, b)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thick: int = 1) -> None:
        """Bresenham, drawn `thick` pixels wide."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        r = thick // 2
        while True:
            for ox in range(-r, thick - r):
                for oy in range(-r, thick - r):
                    self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color: Color = AXIS) -> None:
        """`s` with its top-left corner at (x, y); upper case is drawn as lower case."""
        for n, ch in enumerate(s.lower()):
            rows = _FONT.get(ch, _FONT["?"])
            for j, bits in enumerate(rows):
                for i in range(5):
                    if bits & (1 << (4 - i)):
                        self.set(x + n * GLYPH_W + i, y + j, color)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def text_width(s: str) -> int:
    return len(s) * GLYPH_W - 1


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks: list[float] = []
    v = first
    # Up to the first tick at or above hi: the chart's top is the last tick, and a point above it
    # would be drawn off the axes (pair's 0.95 on seed did, before).
    while not ticks or ticks[-1] < hi - step * 1e-9:
        ticks.append(round(v, 10))
        v += step
    return ticks


def _label(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.0e}"


def line_chart(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    shade_below: Sequence[tuple[float, float]] = (),
    title: str = "",
    x_label: str = "load",
    y_label: str = "mean response s",
    width: int = 800,
    height: int = 500,
) -> tuple[bytes, dict[str, Color]]:
    """The PNG of one polyline per series (x, y points) and the colour each series got.

    `shade_below`: a curve whose area down to the x axis is shaded (the lower bound).
    Non-finite points are left out.
    """
    clean = {
        name: sorted((x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y))
        for name, pts in series.items()
    }
    bound = sorted((x, y) for x, y in shade_below if math.isfinite(x) and math.isfinite(y))
    xs = [x for pts in clean.values() for x, _ in pts] + [x for x, _ in bound]
    ys = [y for pts in clean.values() for _, y in pts] + [y for _, y in bound]
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x_hi <= x_lo:
        x_lo, x_hi = x_lo - 0.05, x_hi + 0.05
    x_ticks = nice_ticks(x_lo, x_hi, 6)
    x_lo, x_hi = min(x_lo, x_ticks[0]), max(x_hi, x_ticks[-1])
    positive = [y for y in ys if y > 0]
    # Policies 100x apart squash the good ones onto the axis: a log scale keeps them all legible.
    log = bool(positive) and max(positive) / min(positive) > 30
    if log:
        y_lo = 10.0 ** math.floor(math.log10(min(positive)))
        y_hi = 10.0 ** math.ceil(math.log10(max(positive)))
        y_ticks = [10.0**e for e in range(round(math.log10(y_lo)), round(math.log10(y_hi)) + 1)]
    else:
        y_ticks = nice_ticks(0.0, max(ys) if ys else 1.0, 6)
        y_lo, y_hi = 0.0, y_ticks[-1]

    colors = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(clean)}
    legend_w = 12 + 16 + max((text_width(n) for n in clean), default=0) + 12
    left = 14 + max(text_width(_label(v)) for v in y_ticks) + 10
    right = width - legend_w - 10
    top, bottom = 30, height - 40

    def px(x: float) -> int:
        return round(left + (x - x_lo) / (x_hi - x_lo) * (right - left))

    def py(y: float) -> int:
        if log:
            frac = (math.log10(max(y, y_lo)) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo))
        else:
            frac = (y - y_lo) / (y_hi - y_lo)
        return round(bottom - frac * (bottom - top))

    c = Canvas(width, height)
    # The shaded region first, so that lines and axes draw over it.
    for a, b in pairwise(bound):
        xa, xb = px(a[0]), px(b[0])
        for x in range(xa, xb + 1):
            t = 0.0 if xb == xa else (x - xa) / (xb - xa)
            c.rect(x, py(a[1] + t * (b[1] - a[1])), x, bottom, SHADE)
    c.line(left, bottom, right, bottom, AXIS)
    c.line(left, top, left, bottom, AXIS)
    for v in x_ticks:
        tx = px(v)
        c.line(tx, bottom, tx, bottom + 4, AXIS)
        c.text(tx - text_width(_label(v)) // 2, bottom + 8, _label(v))
    for v in y_ticks:
        ty = py(v)
        c.line(left - 4, ty, left, ty, AXIS)
        c.text(left - 7 - text_width(_label(v)), ty - GLYPH_H // 2, _label(v))
    c.text((left + right - text_width(x_label)) // 2, bottom + 22, x_label)
    c.text(4, 8, y_label + (" (log)" if log else ""))
    if title:
        c.text(max(left, (width - text_width(title)) // 2), 8, title)
    for name, pts in clean.items():
        col = colors[name]
        for a, b in pairwise(pts):
            c.line(px(a[0]), py(a[1]), px(b[0]), py(b[1]), col, thick=2)
        for pt in pts:
            mx, my = px(pt[0]), py(pt[1])
            c.rect(mx - 2, my - 2, mx + 2, my + 2, col)
    lx, ly = right + 20, top
    for name in clean:
        c.rect(lx, ly, lx + 10, ly + 7, colors[name])
        c.text(lx + 16, ly, name)
        ly += 14
    if bound:
        c.rect(lx, ly, lx + 10, ly + 7, SHADE)
        c.text(lx + 16, ly, "below bound")
    return c.png(), colors
