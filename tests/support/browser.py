"""Headless Chromium (the OS packages ``chromium`` and ``chromium-driver``) driven by Selenium, for the
chat page tests. Nothing is downloaded: Selenium's driver manager is kept offline and pointed at the
installed chromedriver."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

CHROMIUM = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and os.path.exists(p)), None)
CHROMEDRIVER = next((p for p in (shutil.which("chromedriver"), "/usr/bin/chromedriver") if p and os.path.exists(p)),
                    None)
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-extensions",
         "--no-first-run", "--no-default-browser-check", "--window-size=1280,800", "--force-device-scale-factor=1")

needs_browser = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Chromium and chromedriver from the OS packages: apt-get install -y chromium chromium-driver")


@contextlib.contextmanager
def chromium(profile_dir):
    """A headless Chromium session (a Selenium WebDriver) with its profile in ``profile_dir``."""
    from selenium import webdriver  # the test extra installs it
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # never let Selenium fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(60)
        yield driver
    finally:
        driver.quit()


def screenshot(driver, path):
    """Save a PNG of the page and check that something was drawn: returns the number of distinct colours."""
    from PIL import Image

    assert driver.save_screenshot(str(path)), path
    with Image.open(path) as image:
        assert image.size[0] >= 1000 and image.size[1] >= 600, image.size
        colours = len(image.convert("RGB").getcolors(1 << 24))
    assert colours > 50, f"{path}: the page looks blank ({colours} colours)"
    return colours
