"""Headless Chromium for the web page's test: Debian's ``chromium`` and ``chromium-driver``,
driven by Selenium with both paths given, so selenium-manager never downloads a browser or
a driver. Missing, the test fails and says how to install them (``.ci/run`` does)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

HOW_TO_GET_CHROMIUM = (
    "install Debian's headless browser and its driver: "
    "'apt-get install -y chromium chromium-driver' (CI: .ci/run does it)"
)
WINDOW = "1000,760"


def _find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found is not None:
            return found
    return None


def open_chromium(profile_dir: Path, *, window: str = WINDOW) -> webdriver.Chrome:
    """A headless Chromium with a profile of its own under ``profile_dir``; fails (pytest)
    saying how to install the browser when it or its driver is missing."""
    browser = _find("chromium", "chromium-browser")
    driver = _find("chromedriver")
    if browser is None or driver is None:
        missing = "chromium" if browser is None else "chromedriver"
        pytest.fail(f"the web page test needs {missing}: {HOW_TO_GET_CHROMIUM}", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-dev-shm-usage",
        f"--window-size={window}",
        f"--user-data-dir={profile_dir}",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    """A headless Chromium with a profile of its own (fresh localStorage) under tmp_path."""
    session = open_chromium(tmp_path / "chromium-profile")
    try:
        yield session
    finally:
        session.quit()
