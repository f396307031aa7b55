"""The manual's pictures: the script that makes them runs (its quick mode: small plots, no
dashboard), every image a page shows is a file in docs/, and every picture the script makes is
shown somewhere, so a renamed picture cannot leave a stale file or a broken image behind."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

from docs.pictures import IMG, names

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Markdown images, `![alt](target)`, and HTML ones, `<img src="target">`.
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)[^)]*\)|<img[^>]*\bsrc=\"([^\"]+)\"")


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _shown() -> dict[Path, list[str]]:
    """Each image file the pages point at, with the pages that do."""
    shown: dict[Path, list[str]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for md, html in IMAGE.findall(page.read_text()):
            target = md or html
            assert "://" not in target, f"{page.name} shows an image from outside the repository: {target}"
            shown.setdefault((page.parent / target).resolve(), []).append(page.name)
    return shown


def test_the_pictures_script_draws_the_simulators_plots_in_its_quick_mode(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "docs.pictures", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    drawn = sorted(p.name for p in tmp_path.iterdir())
    assert drawn == sorted(names(quick=True))
    assert _png_size((tmp_path / drawn[0]).read_bytes()) == (800, 500)
    assert f"wrote {tmp_path / drawn[0]}" in done.stdout


def test_every_image_a_page_shows_is_a_png_in_docs() -> None:
    shown = _shown()
    assert shown, "no page shows an image: the pattern no longer matches the pages"
    for path, pages in shown.items():
        where = ", ".join(pages)
        assert path.is_relative_to(DOCS), f"{path}, shown by {where}, is outside docs/"
        assert path.is_file(), f"{path.relative_to(ROOT)}, shown by {where}, does not exist"
        _png_size(path.read_bytes())


def test_every_picture_the_script_makes_is_committed_and_shown_by_a_page() -> None:
    made = {IMG / name for name in names(quick=False)}
    assert set(IMG.iterdir()) == made, "docs/img/ holds a picture the script does not make"
    assert made <= set(_shown()), "a picture the script makes is shown by no page"
