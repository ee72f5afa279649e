"""Regenerate the screenshots of the NanGuard tab (``docs/dashboard-*.png``: the docs' TensorBoard page, the README).

Runs both demos into a fresh log directory, starts TensorBoard on it (127.0.0.1, a free port),
and photographs the tab's three views in Debian's headless chromium through selenium (the same
browser the dashboard tests use)::

    .venv/bin/python scripts/dashboard_screenshots.py            # writes docs/dashboard-*.png
    .venv/bin/python scripts/dashboard_screenshots.py --out /tmp  # somewhere else
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from dashboard_runs import tensorboard_server, wait_for  # noqa: E402  (tests/helpers/dashboard_runs.py)
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

CHROMIUM = os.environ.get("NANGUARD_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("NANGUARD_CHROMEDRIVER", "/usr/bin/chromedriver")


def run_demos(scratch: Path) -> Path:
    """Both demos, run as a user runs them from a checkout, into ``scratch/nanguard_demo_logs``."""
    for folder in ("examples", "configs"):
        (scratch / folder).symlink_to(ROOT / folder)  # paths read examples/..., relative to the run's directory
    demos = (
        ["examples/cosine_norm_demo.py", "fit", "--config", "configs/demo.yaml", "--config", "configs/nanguard.yaml"],
        ["examples/dashboard_demo.py"],
    )
    for demo in demos:
        subprocess.run([sys.executable, *demo], cwd=scratch, check=True, capture_output=True)
    return scratch / "nanguard_demo_logs"


def set_viewport(driver: webdriver.Chrome, width: int, height: int) -> None:
    """Make the page (not the window around it) ``width`` x ``height`` pixels."""
    driver.set_window_size(width, height)
    inner = driver.execute_script("return [window.innerWidth, window.innerHeight];")
    driver.set_window_size(2 * width - inner[0], 2 * height - inner[1])


def ready(driver: webdriver.Chrome, view: str) -> bool:
    """Whether the tab has finished drawing ``view``."""
    return bool(
        driver.execute_script(
            "const root = document.getElementById('nanguard');"
            "return root && root.dataset.ready === arguments[0] && !document.querySelector('.view[aria-busy=true]');",
            view,
        )
    )


def show(driver: webdriver.Chrome, view: str) -> None:
    """Switch the tab to ``view`` and wait until it is drawn."""
    driver.find_element(By.CSS_SELECTOR, f".tabs button[data-view={view}]").click()
    wait_for(lambda: ready(driver, view))
    time.sleep(0.5)  # let the thumbnails and the highlighted source finish painting


def open_an_incident(driver: webdriver.Chrome, run: str) -> None:
    """Open an incident of ``run`` with samples, a user's source line and a bundle (cause data, most samples)."""
    picker = driver.find_element(By.CSS_SELECTOR, "select.run-picker")
    picker.find_element(By.CSS_SELECTOR, f"option[value='{run}']").click()
    wait_for(
        lambda: (
            ready(driver, "incidents")
            and driver.find_element(By.CSS_SELECTOR, ".incident").get_attribute("data-run") == run
        )
    )
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.incident-row")
    data_rows = [row for row in rows if " data " in f" {row.text} "] or rows
    max(reversed(data_rows), key=lambda row: row.text.count(",")).click()
    wait_for(lambda: ready(driver, "incidents"))
    time.sleep(1.0)  # the thumbnails


def main() -> None:
    """Run the demos, start TensorBoard, photograph the three views."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the PNG files go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        logdir = run_demos(Path(scratch))
        options = Options()
        for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1440,1107"):
            options.add_argument(argument)
        options.binary_location = CHROMIUM
        # the log directory as a user gives it, relative: the replay command shown is then the one to type
        with tensorboard_server(logdir.relative_to(scratch), Path(scratch)) as server:
            driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
            try:
                driver.get(f"{server.url}/#nanguard")
                frame = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "iframe"))[0]
                driver.switch_to.frame(frame)
                wait_for(
                    lambda: (
                        ready(driver, "timeline") and len(driver.find_elements(By.CSS_SELECTOR, ".timeline-card")) == 2
                    )
                )
                for view, height in (("timeline", 1107), ("incidents", 1257), ("summary", 1107)):
                    driver.switch_to.default_content()  # the page's size, not the tab's frame
                    set_viewport(driver, 1440, height)
                    driver.switch_to.frame(frame)
                    show(driver, view)
                    if view == "incidents":
                        open_an_incident(driver, "dashboard_demo/version_0")
                    driver.switch_to.default_content()
                    driver.save_screenshot(str(args.out / f"dashboard-{view}.png"))
            finally:
                driver.quit()
    print(f"wrote {args.out}/dashboard-timeline.png, dashboard-incidents.png, dashboard-summary.png")


if __name__ == "__main__":
    main()
