"""The pure-Python PNG chart of `sim schedule --plot`."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from typer.testing import CliRunner

from routeledger.cli import app
from sim.scheduling.plot import BACKGROUND, SHADE, line_chart, nice_ticks


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB PNG, checking every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    kinds: list[bytes] = []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        kinds.append(kind)
        if kind == b"IHDR":
            width, height, depth, color, *_ = struct.unpack(">IIBBBBB", body)
            assert (depth, color) == (8, 2)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    raw = zlib.decompress(idat)
    stride = 3 * width + 1
    rows = [raw[i * stride : (i + 1) * stride] for i in range(height)]
    assert all(r[0] == 0 for r in rows)  # filter type none, as written
    return width, height, [r[1:] for r in rows]


def colours_in(rows: list[bytes]) -> set[tuple[int, int, int]]:
    return {(r[i], r[i + 1], r[i + 2]) for r in rows for i in range(0, len(r), 3)}


def test_a_chart_is_a_valid_png_of_the_asked_size_with_every_policy_drawn_in_its_own_colour() -> None:
    series = {
        "routeledger": [(0.3, 10.0), (0.6, 14.0), (0.9, 50.0)],
        "least-busy": [(0.3, 28.0), (0.6, 32.0), (0.9, 70.0)],
        "best-threshold": [(0.3, 9.8), (0.6, 13.5), (0.9, 49.0)],
    }
    png, colours = line_chart(
        series, shade_below=[(0.3, 5.0), (0.6, 7.0), (0.9, 20.0)], width=640, height=400
    )
    width, height, rows = decode_png(png)
    assert (width, height) == (640, 400)
    seen = colours_in(rows)
    assert BACKGROUND in seen and SHADE in seen
    assert len(set(colours.values())) == len(series)
    for name in series:
        assert colours[name] in seen, name


def test_the_ticks_reach_at_or_above_the_highest_value_so_no_line_leaves_the_top_of_the_chart() -> None:
    for lo, hi in [(0.0, 115.0), (0.0, 100.0), (0.0, 0.7), (0.3, 0.95), (2.0, 2.0)]:
        ticks = nice_ticks(lo, hi, 6)
        assert ticks[0] <= lo and ticks[-1] >= hi, (lo, hi, ticks)
    assert nice_ticks(0.0, 100.0, 5) == [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]


def test_points_that_are_not_finite_are_left_out_and_the_chart_is_still_drawn() -> None:
    png, colours = line_chart({"stuck": [(0.3, float("inf")), (0.6, 3.0), (0.9, 4.0)]})
    _, _, rows = decode_png(png)
    assert colours["stuck"] in colours_in(rows)


def test_sim_schedule_writes_the_plot_it_is_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "chart.png"
    result = CliRunner().invoke(
        app,
        [
            "sim",
            "schedule",
            "--fleet",
            "seed",
            "--load",
            "0.3,0.6",
            "--tasks",
            "200",
            "--policies",
            "routeledger,least-busy",
            "--plot",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    width, height, rows = decode_png(out.read_bytes())
    assert (width, height) == (800, 500)
    assert len(colours_in(rows)) > 4
