"""TensorBoard's own server on a run's event files, on loopback, and its loss chart opened in headless Chromium
(Debian's, driven by Playwright): what a person watching the run sees. For tests/test_tracking.py, and for the
picture in docs/running.md: ``python -m tests.tensorboard_view <run>/tensorboard docs/images/tensorboard.png``."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from tests.browser import CHROMIUM, CHROMIUM_FLAGS
from tests.servers import ServerProcess


@dataclass
class LossChart:
    points: int  # vertices of the chart's raw (unsmoothed) line
    table: str  # the card's data table: run, smoothed, value, step, relative time


class TensorBoard(ServerProcess):
    """`tensorboard --logdir` on a free loopback port, in its own process."""

    name = "tensorboard"
    ready_path = "/data/environment"

    def __init__(self, logdir: Path, log_file: Path):
        super().__init__(log_file)
        self.logdir = logdir

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(self.logdir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]


def loss_chart(url: str, screenshot: Path, width: int = 1400, height: int = 900) -> LossChart:
    """The Time Series tab filtered to train/loss, drawn as SVG (TensorBoard's WebGL needs a GPU): the chart's raw
    line and data table once drawn, and a screenshot of the page."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(f"{url}/?forceSVG=true&tagFilter=train%2Floss#timeseries")
            card = page.locator("scalar-card", has_text="train/loss").first
            lines = card.locator(".series-view svg path")
            lines.first.wait_for(timeout=60_000)  # the raw line, then the smoothed one over it
            raw = lines.first.get_attribute("d") or ""
            table = " ".join(card.locator(".data-table").inner_text().split())
            page.screenshot(path=str(screenshot))
        finally:
            browser.close()
    return LossChart(points=raw.count("L") + raw.count("M"), table=table)


if __name__ == "__main__":
    logdir, picture = Path(sys.argv[1]), Path(sys.argv[2])
    with TensorBoard(logdir, picture.with_suffix(".log")) as board:
        print(loss_chart(board.url, picture))
