"""The console in a real browser: Debian's chromium driven by Selenium, against the session's service with a real job
worker (`training_service` of tests/conftest.py: SQLite, SeaweedFS, inkling-tiny), which the SDK's training tests
share. One browser for the whole module."""

import base64
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service as DriverService

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Set to write each page's screenshot into docs/console/ as well (the README shows one).
DOCS_ENV = "INKWELL_CONSOLE_SCREENSHOTS"
DOCS_DIR = Path(__file__).resolve().parents[2] / "docs" / "console"
WIDE = (1280, 900)
MAX_SHOT_HEIGHT = 2000


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    """Headless chromium at 1280 px (`make test` installs it: the Makefile's chromium stamp)."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("chromium and chromium-driver are required: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={WIDE[0]},{WIDE[1]}")
    driver = webdriver.Chrome(options=options, service=DriverService(CHROMEDRIVER))
    driver.set_window_size(*WIDE)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def screenshot(browser, tmp_path_factory):
    """screenshot(name): the whole page as PNG into the test's tmp dir, and into docs/console/ when
    INKWELL_CONSOLE_SCREENSHOTS is set."""
    out = tmp_path_factory.mktemp("console-screenshots")

    def take(name: str) -> Path:
        path = out / f"{name}.png"
        layout = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})
        height = max(layout["cssContentSize"]["height"], layout["cssLayoutViewport"]["clientHeight"])
        clip = {"x": 0, "y": 0, "width": layout["cssLayoutViewport"]["clientWidth"], "scale": 1}
        clip["height"] = min(height, MAX_SHOT_HEIGHT)  # the whole page, not only the fold
        shot = browser.execute_cdp_cmd(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        if os.environ.get(DOCS_ENV):
            DOCS_DIR.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, DOCS_DIR / path.name)
        return path

    return take
