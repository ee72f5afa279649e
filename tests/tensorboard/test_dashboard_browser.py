"""The NanGuard tab in a real headless browser (Debian's chromium driven by selenium) over a real TensorBoard.

Asserts what a user sees: the tab, the incident markers, the incident list, the culprit source line
highlighted, the thumbnail, the bundle status and the run summary, for runs of both namespaces.
Skipped, with the reason, where chromium and chromedriver are not installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_runs import (
    BATCH_HINT,
    BLAME_NOTE,
    BLANK,
    LOADERS_RUN,
    SPIKE_EVENT,
    UNVERIFIED_BLAME,
    UNVERIFIED_INDICES,
    VERIFIED_RUN,
    TensorBoardServer,
    guarded_image_run,
    guarded_loaders_run,
    origin_line,
    tensorboard_server,
    wait_for,
    write_mixed_run,
    write_verified_run,
)

CHROMIUM = os.environ.get("NANGUARD_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("NANGUARD_CHROMEDRIVER", "/usr/bin/chromedriver")
RUNS = ("lightning/version_0", "pytorch_lightning/version_0")  # guarded image runs of both namespaces
MIXED = "mixed"  # an events.jsonl of an older version next to a loss spike (no TensorBoard scalars)
ALL_RUNS = (RUNS[0], MIXED, RUNS[1], LOADERS_RUN, VERIFIED_RUN)  # the run list is sorted by name

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(
        f"no headless browser: {CHROMIUM} and {CHROMEDRIVER} are needed (Debian: apt-get install -y chromium "
        "chromium-driver; `CI=true bash scripts/test.sh` installs them when run as root)",
        allow_module_level=True,
    )

from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def server(logdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TensorBoardServer]:
    for ns in ("lightning", "pytorch_lightning"):
        guarded_image_run(ns, logdir)
    write_mixed_run(logdir / MIXED)
    guarded_loaders_run(logdir)
    write_verified_run(logdir)
    with tensorboard_server(logdir, tmp_path_factory.mktemp("tb")) as tb:
        assert wait_for(lambda: json.loads(tb.get(f"/data/plugin/nanguard/timeline?run={RUNS[1]}")[2])["grad_norm"])
        yield tb


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = Options()
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-extensions",
        "--window-size=1500,1100",
    ):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: WebDriver, condition: Any, timeout: float = 60.0) -> Any:
    try:
        return WebDriverWait(driver, timeout).until(lambda d: condition(d))
    except TimeoutException:
        logs = "\n".join(str(entry) for entry in driver.get_log("browser"))
        raise AssertionError(f"the page never got there; browser console:\n{logs}") from None


def ready(driver: WebDriver, view: str) -> bool:
    return bool(
        driver.execute_script(
            "const root = document.getElementById('nanguard');"
            "const busy = document.querySelector('.view[aria-busy=true]');"
            "return root && root.dataset.ready === arguments[0] && !busy;",
            view,
        )
    )


@pytest.fixture
def tab(server: TensorBoardServer, browser: WebDriver) -> WebDriver:
    """TensorBoard opened on the NanGuard tab, the driver switched into the tab's iframe."""
    return open_tab(server, browser)


def texts(driver: WebDriver, selector: str) -> list[str]:
    return [element.text for element in driver.find_elements(By.CSS_SELECTOR, selector)]


def show(driver: WebDriver, view: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f".tabs button[data-view={view}]").click()
    wait(driver, lambda d: ready(d, view))


def test_tab_is_in_tensorboards_header(server: TensorBoardServer, browser: WebDriver) -> None:
    browser.switch_to.default_content()
    browser.get(f"{server.url}/#nanguard")
    wait(browser, lambda d: "NANGUARD" in d.find_element(By.TAG_NAME, "body").text.upper())
    assert browser.find_elements(By.CSS_SELECTOR, "iframe")


def test_timeline_shows_every_incident_of_every_selected_run(tab: WebDriver, tmp_path: Path) -> None:
    cards = tab.find_elements(By.CSS_SELECTOR, ".timeline-card")
    assert [card.get_attribute("data-run") for card in cards] == list(ALL_RUNS)  # side by side, one per run
    for card in (cards[0], cards[2]):
        steps = [m.get_attribute("data-step") for m in card.find_elements(By.CSS_SELECTOR, "g.marker")]
        assert steps == ["1", "3", "5", "7"]
        assert "4 incidents at 4 steps" in card.text
        labels = [t.text for t in card.find_elements(By.CSS_SELECTOR, "text.panel-label")]
        assert labels[0].startswith("gradient norm") and labels[1].startswith("train_loss")
        assert card.find_element(By.CSS_SELECTOR, "path.series.grad").get_attribute("d").startswith("M")
    assert "NaN/Inf" in tab.find_element(By.CSS_SELECTOR, ".legend").text
    mixed = cards[1]
    assert [m.get_attribute("class") for m in mixed.find_elements(By.CSS_SELECTOR, "g.marker")] == [
        "marker g-nonfinite",
        "marker g-spike",
    ]
    assert "no finite values logged" in mixed.text  # a run without TensorBoard scalars still has its markers
    tab.save_screenshot(str(tmp_path / "timeline.png"))


def test_clicking_a_marker_opens_the_incident(tab: WebDriver) -> None:
    card = tab.find_element(By.CSS_SELECTOR, f".timeline-card[data-run='{RUNS[1]}']")
    marker = card.find_elements(By.CSS_SELECTOR, "g.marker")[2]
    tab.execute_script("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", marker)
    wait(tab, lambda d: ready(d, "incidents"))
    assert tab.find_element(By.CSS_SELECTOR, ".incident h3").text == "Step 5"
    assert tab.find_element(By.CSS_SELECTOR, ".incident").get_attribute("data-run") == RUNS[1]


def test_incident_view_shows_samples_source_and_bundle(tab: WebDriver) -> None:
    show(tab, "incidents")
    rows = tab.find_elements(By.CSS_SELECTOR, "tr.incident-row")
    assert [row.find_element(By.CSS_SELECTOR, "td").text for row in rows] == ["1", "3", "5", "7"]
    assert "step skipped" in rows[0].text and f"idx {BLANK[0]}" in rows[0].text
    incident = tab.find_element(By.CSS_SELECTOR, ".incident")
    assert incident.find_element(By.TAG_NAME, "h3").text == "Step 1"
    culprit = incident.find_element(By.CSS_SELECTOR, ".code-line.culprit")
    assert culprit.find_element(By.CSS_SELECTOR, ".ln").text == str(origin_line())
    assert culprit.find_element(By.CSS_SELECTOR, ".code").text.strip() == "return dot / patch_norm  # DASHBOARD-ORIGIN"
    assert len(incident.find_elements(By.CSS_SELECTOR, ".code-line")) == 11  # the line and 5 either side
    assert f"dashboard_runs.py:{origin_line()}" in incident.find_element(By.CSS_SELECTOR, ".file").text
    image = incident.find_element(By.CSS_SELECTOR, ".thumb img")
    wait(tab, lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 12)
    assert f"index {BLANK[0]}" in incident.find_element(By.CSS_SELECTOR, ".thumb figcaption").text
    assert "bundle pruned" in incident.text
    assert "DivBackward0" in incident.text and "net.0" in incident.text

    rows[3].click()
    wait(tab, lambda d: ready(d, "incidents") and d.find_element(By.CSS_SELECTOR, ".incident h3").text == "Step 7")
    command = tab.find_element(By.CSS_SELECTOR, "pre.command").text
    assert command.startswith("python -m lightning_nanguard replay ") and command.endswith("step-7")


def test_summary_side_by_side(tab: WebDriver) -> None:
    show(tab, "summary")
    cards = tab.find_elements(By.CSS_SELECTOR, ".summary-card")
    assert [card.get_attribute("data-run") for card in cards] == list(ALL_RUNS)
    assert texts(cards[1], ".tile-value") == ["2", "1", "0", "0"]
    for card in (cards[0], cards[2]):
        assert texts(card, ".tile-value") == ["4", "4", "2", "1"]  # incidents, skipped, dataset items, origins
        indices = [
            row.find_elements(By.TAG_NAME, "td")[0].text
            for row in card.find_elements(By.CSS_SELECTOR, "table.ranked")[0].find_elements(By.CSS_SELECTOR, "tbody tr")
        ]
        assert indices == [str(BLANK[0]), str(BLANK[1])]
        assert f"dashboard_runs.py:{origin_line()}" in card.find_elements(By.CSS_SELECTOR, "table.ranked")[1].text
        assert "4 steps skipped" in card.find_element(By.CSS_SELECTOR, ".lost").text


def test_run_selector(tab: WebDriver) -> None:
    boxes = tab.find_elements(By.CSS_SELECTOR, ".run-list input[type=checkbox]")
    assert [box.get_attribute("value") for box in boxes] == list(ALL_RUNS)
    boxes[0].click()
    wait(tab, lambda d: ready(d, "timeline") and len(d.find_elements(By.CSS_SELECTOR, ".timeline-card")) == 4)
    tab.find_elements(By.CSS_SELECTOR, ".run-list input[type=checkbox]")[1].click()  # the list was redrawn
    wait(tab, lambda d: ready(d, "timeline") and len(d.find_elements(By.CSS_SELECTOR, ".timeline-card")) == 3)
    cards = tab.find_elements(By.CSS_SELECTOR, ".timeline-card")
    assert [card.get_attribute("data-run") for card in cards] == [RUNS[1], LOADERS_RUN, VERIFIED_RUN]


def test_older_events_and_spikes_are_shown(tab: WebDriver) -> None:
    show(tab, "incidents")
    picker = tab.find_element(By.CSS_SELECTOR, "select.run-picker")
    picker.find_element(By.CSS_SELECTOR, f"option[value='{MIXED}']").click()
    wait(
        tab,
        lambda d: (
            ready(d, "incidents") and d.find_element(By.CSS_SELECTOR, ".incident").get_attribute("data-run") == MIXED
        ),
    )
    legacy = tab.find_element(By.CSS_SELECTOR, ".incident")
    assert legacy.find_element(By.TAG_NAME, "h3").text == "Step 4"
    assert "net.1: channels [0, 2]" in legacy.text and "No repro bundle was saved" in legacy.text
    assert "The samples were not searched." in legacy.text and not legacy.find_elements(By.CSS_SELECTOR, ".code-line")
    tab.find_elements(By.CSS_SELECTOR, "tr.incident-row")[1].click()
    wait(tab, lambda d: ready(d, "incidents") and d.find_element(By.CSS_SELECTOR, ".incident h3").text == "Step 9")
    spike = tab.find_element(By.CSS_SELECTOR, ".incident")
    rows = {
        row.find_element(By.CSS_SELECTOR, ".k").text: row.find_element(By.CSS_SELECTOR, ".v").text
        for row in spike.find_elements(By.CSS_SELECTOR, "[data-section='Other details'] .kv")
    }
    assert rows == {"threshold": "40", "baseline": "2.1"}
    assert "loss_spike" in spike.find_element(By.CSS_SELECTOR, ".chip-spike").text
    assert not tab.find_elements(By.CSS_SELECTOR, ".error")


def test_several_loaders_are_named_in_the_list_the_incident_and_the_summary(tab: WebDriver) -> None:
    show(tab, "incidents")
    picker = tab.find_element(By.CSS_SELECTOR, "select.run-picker")
    picker.find_element(By.CSS_SELECTOR, f"option[value='{LOADERS_RUN}']").click()
    wait(
        tab,
        lambda d: (
            ready(d, "incidents")
            and d.find_element(By.CSS_SELECTOR, ".incident").get_attribute("data-run") == LOADERS_RUN
        ),
    )
    rows = tab.find_elements(By.CSS_SELECTOR, "tr.incident-row")
    assert "idx a:13, b:6" in rows[0].text and "idx b:9" in rows[1].text
    incident = tab.find_element(By.CSS_SELECTOR, ".incident")
    loaders = {e.get_attribute("data-loader"): e.text for e in incident.find_elements(By.CSS_SELECTOR, ".kv.loader")}
    assert "positions [5] of 8 · dataset indices [13]" in loaders["a"]
    assert "positions [2] of 4 · dataset indices [6]" in loaders["b"]
    assert "loader_batch_sizes" not in incident.text  # shown with the samples, not under "other details"
    show(tab, "summary")
    card = tab.find_element(By.CSS_SELECTOR, f".summary-card[data-run='{LOADERS_RUN}']")
    table = card.find_elements(By.CSS_SELECTOR, "table.ranked")[0]
    assert [th.text for th in table.find_elements(By.TAG_NAME, "th")][:2] == ["loader", "dataset index"]
    cells = [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")][:2]
        for tr in table.find_elements(By.CSS_SELECTOR, "tbody tr")
    ]
    assert cells == [["b", "6"], ["b", "9"], ["a", "13"]]


def open_incident(driver: WebDriver, run: str, step: int) -> WebElement:
    """Open the incident of ``run`` at ``step`` from the incident list; the incident view once drawn."""
    show(driver, "incidents")
    if driver.find_element(By.CSS_SELECTOR, ".incident").get_attribute("data-run") != run:
        picker = driver.find_element(By.CSS_SELECTOR, "select.run-picker")
        picker.find_element(By.CSS_SELECTOR, f"option[value='{run}']").click()
        wait(
            driver,
            lambda d: (
                ready(d, "incidents") and d.find_element(By.CSS_SELECTOR, ".incident").get_attribute("data-run") == run
            ),
        )
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.incident-row")
    row = next(r for r in rows if r.find_element(By.CSS_SELECTOR, "td").text == str(step))
    row.click()
    return wait(driver, lambda d: ready(d, "incidents") and drawn_incident(d, run, step))


def drawn_incident(driver: WebDriver, run: str, step: int) -> WebElement | None:
    """The incident view when it shows ``run`` at ``step`` (one look-up: the element compared is the one returned)."""
    incidents = driver.find_elements(By.CSS_SELECTOR, f".incident[data-run='{run}']")
    if incidents and incidents[0].find_element(By.TAG_NAME, "h3").text == f"Step {step}":
        return incidents[0]
    return None


def values(incident: WebElement, selector: str) -> list[str]:
    return [e.text for e in incident.find_elements(By.CSS_SELECTOR, f"{selector} .v")]


def test_what_the_guard_verified_is_marked_in_the_list_the_incident_and_the_summary(tab: WebDriver) -> None:
    verified = open_incident(tab, VERIFIED_RUN, 2)
    rows = [r.find_elements(By.TAG_NAME, "td") for r in tab.find_elements(By.CSS_SELECTOR, "tr.incident-row")]
    assert [r[4].text for r in rows] == ["idx 27, 29", "idx 27, 31 (not verified)", "idx [10, 11], [40]", ""]
    assert ["mark-unverified" in r[4].get_attribute("class") for r in rows] == [False, True, False, False]
    assert [r[2].text for r in rows] == ["data", "data", "data", "batch"]
    assert values(verified, ".kv.indices") == ["[27, 29] (verified)"]
    assert values(verified, ".kv.blame") == ["verified: bad beside known-healthy samples (+1 pass)"]
    assert len(verified.find_elements(By.CSS_SELECTOR, ".mark-verified")) == 2
    assert not verified.find_elements(By.CSS_SELECTOR, ".mark-unverified")
    assert not verified.find_elements(By.CSS_SELECTOR, "[data-section='Other details']")  # verify_passes is shown

    doubted = open_incident(tab, VERIFIED_RUN, 4)
    assert values(doubted, ".kv.indices") == [f"[27, 31] (not verified: {UNVERIFIED_INDICES})"]
    assert values(doubted, ".kv.blame") == [f"not verified: {UNVERIFIED_BLAME}"]
    assert len(doubted.find_elements(By.CSS_SELECTOR, ".mark-unverified")) == 2
    assert "indices_unverified" not in doubted.text and "blame_unverified" not in doubted.text

    packed = open_incident(tab, VERIFIED_RUN, 6)
    assert values(packed, ".kv.records") == ["#1: [10, 11] · #6: [40] (verified)"]
    assert values(packed, ".kv.blame") == [f"verified: bad beside known-healthy samples (+1 pass); {BLAME_NOTE}"]
    captions = [e.text.split("\n")[0] for e in packed.find_elements(By.CSS_SELECTOR, ".thumb figcaption")]
    assert captions == ["#1 · records 10, 11", "#6 · records 40"]

    batch = open_incident(tab, VERIFIED_RUN, 8)
    chip = batch.find_element(By.CSS_SELECTOR, ".chip-cause")
    assert chip.text == "cause: batch" and chip.get_attribute("title").startswith(
        "the batch as a whole, no record is at fault"
    )
    assert "The batch as a whole is at fault: no record is named, nothing is quarantined." in batch.text
    assert "Cause: batch (the batch as a whole, no record is at fault" in batch.text
    assert batch.find_element(By.CSS_SELECTOR, ".hint").text == BATCH_HINT
    assert not batch.find_elements(By.CSS_SELECTOR, ".kv.blame, .kv.indices")

    show(tab, "summary")
    card = tab.find_element(By.CSS_SELECTOR, f".summary-card[data-run='{VERIFIED_RUN}']")
    causes = {
        row.find_element(By.CSS_SELECTOR, ".bar-label").text: row.find_element(By.CSS_SELECTOR, ".bar-count").text
        for row in card.find_elements(By.CSS_SELECTOR, "[data-section='By cause'] .bar-row")
    }
    assert causes == {"data": "3", "batch": "1"}
    table = card.find_elements(By.CSS_SELECTOR, "table.ranked")[0]
    assert [th.text for th in table.find_elements(By.TAG_NAME, "th")] == [
        "dataset index",
        "incidents",
        "steps",
        "checked",
    ]
    cells = [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        for tr in table.find_elements(By.CSS_SELECTOR, "tbody tr")
    ]
    assert [(c[0], c[3]) for c in cells] == [
        ("27", "not verified"),
        ("10", "verified"),
        ("11", "verified"),
        ("29", "verified"),
        ("31", "not verified"),
        ("40", "verified"),
    ]


def open_tab(server: TensorBoardServer, browser: WebDriver) -> WebDriver:
    """TensorBoard opened on the NanGuard tab, the driver switched into the tab's iframe."""
    browser.switch_to.default_content()
    browser.get("about:blank")  # a fresh page: the same URL with a hash would not reload the tab
    browser.get(f"{server.url}/#nanguard")
    frame = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "iframe"))[0]
    browser.switch_to.frame(frame)
    wait(browser, lambda d: ready(d, "timeline"))
    return browser


def timeline_now(driver: WebDriver) -> dict[str, Any] | None:
    """What the drawn timeline shows, read in one script (a poll cannot redraw the tab between two look-ups).

    ``{"counts": {run: incident count in the run list}, "steps": {run: marker steps}}``, or ``None``
    while the tab is drawing.
    """
    return driver.execute_script(
        "const root = document.getElementById('nanguard');"
        "const busy = document.querySelector('.view[aria-busy=true]');"
        "if (!root || root.dataset.ready !== 'timeline' || busy) return null;"
        "const counts = {}, steps = {};"
        "for (const label of document.querySelectorAll('.run-list label'))"
        "  counts[label.title] = label.querySelector('.count').textContent;"
        "for (const card of document.querySelectorAll('.timeline-card'))"
        "  steps[card.dataset.run] = [...card.querySelectorAll('g.marker')].map((m) => m.getAttribute('data-step'));"
        "return {counts, steps};"
    )


def test_a_live_run_shows_new_incidents_by_itself(server: TensorBoardServer, logdir: Path, tab: WebDriver) -> None:
    """A run still training: an incident appended to its events.jsonl appears without a reload."""
    events = logdir / MIXED / "nanguard" / "events.jsonl"
    original = events.read_text(encoding="utf-8")
    tab.execute_script("window.localStorage.setItem('nanguard.pollSeconds', '1');")
    try:
        tab = open_tab(server, tab)  # the interval is read when the tab loads
        before = wait(tab, timeline_now)
        assert before["counts"][MIXED] == "2" and "99" not in before["steps"][MIXED]
        with events.open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(dict(SPIKE_EVENT, global_step=99, batch_idx=99)) + "\n")
        # the final state, read at once: the count in the run list and the marker drawn by the same redraw
        after = wait(
            tab, lambda d: (now := timeline_now(d)) and "99" in now["steps"].get(MIXED, []) and now, timeout=30
        )
        assert after["counts"][MIXED] == "3"
        assert after["counts"][RUNS[0]] == "4"  # the other runs are untouched
    finally:
        events.write_text(original, encoding="utf-8")
        tab.execute_script("window.localStorage.removeItem('nanguard.pollSeconds');")


def test_no_errors_in_the_browser_console(tab: WebDriver) -> None:
    for view in ("incidents", "summary", "timeline"):
        show(tab, view)
    assert not tab.find_elements(By.CSS_SELECTOR, ".error")
    severe = [e for e in tab.get_log("browser") if e["level"] == "SEVERE" and "nanguard" in e["message"]]
    assert severe == []
