"""The NanGuard tab in a real headless browser (Debian's chromium driven by selenium) over a real TensorBoard.

Asserts what a user sees: the tab, the incident markers, the incident list, the culprit source line
highlighted, the thumbnail, the bundle status and the run summary, for runs of both namespaces.
Skipped, with the reason, where chromium and chromedriver are not installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
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

from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    NoSuchFrameException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

REDRAWN = (NoSuchElementException, StaleElementReferenceException, NoSuchFrameException)
"""What a look-up meets when the tab (or TensorBoard) redraws under it: the wait looks again."""

Finder = Callable[[WebDriver], WebElement | None]


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


# ------------------------------------------------------------------------------------ reading the page
#
# The tab redraws a whole view at once (index.js refresh(): the run list and the view are replaced, the new
# view is marked aria-busy until drawn), on a click, on a poll that found new incidents, on a resize. A test
# therefore never checks a condition and then looks the page up again, nor keeps elements across a redraw:
# `look` reads what it asserts on inside the wait, from one drawn view (the same view element before and
# after the read, so no redraw started in between), as plain values; `click` finds what it clicks inside
# the wait. A redraw under a read (a stale or missing element) makes the wait read again.


def wait(
    driver: WebDriver,
    condition: Callable[[WebDriver], Any],
    timeout: float = 60.0,
    seen: Callable[[], Any] | None = None,
) -> Any:
    """``condition(driver)`` once truthy, polled; stale or missing elements (a redraw) make it poll again.

    ``seen``: what was last read, told when the page never got there.
    """
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=REDRAWN).until(condition)
    except TimeoutException:
        logs = "\n".join(str(entry) for entry in driver.get_log("browser"))
        last = f"\nlast read: {seen()!r}" if seen is not None else ""
        raise AssertionError(f"the page never got there{last}\nbrowser console:\n{logs}") from None


def drawn(driver: WebDriver, view: str) -> WebElement | None:
    """The tab's view element when the tab shows ``view`` fully drawn (none while it draws)."""
    return driver.execute_script(
        "const root = document.getElementById('nanguard');"
        "const shown = document.querySelector('#nanguard main > .view');"
        "return root && root.dataset.ready === arguments[0] && shown && shown.getAttribute('aria-busy') === 'false'"
        "  ? shown : null;",
        view,
    )


def look(
    driver: WebDriver,
    view: str,
    read: Callable[[WebDriver], Any],
    until: Callable[[Any], bool] | None = None,
    timeout: float = 60.0,
) -> Any:
    """``read(driver)`` of the tab showing ``view`` drawn, once ``until(what was read)`` holds.

    ``read`` looks elements up afresh and returns plain values (no elements). A read is kept only when the
    same drawn view is shown before and after it: a read that a redraw interrupted is made again.
    """
    last: list[Any] = []

    def attempt(d: WebDriver) -> tuple[Any] | None:
        shown = drawn(d, view)
        if shown is None:
            return None
        value = read(d)
        if drawn(d, view) != shown:  # redrawn while read
            return None
        last[:] = [value]
        return (value,) if until is None or until(value) else None

    return wait(driver, attempt, timeout, seen=lambda: last[0] if last else None)[0]


def click(driver: WebDriver, view: str, find: Finder, *, dispatch: bool = False) -> None:
    """Click what ``find`` finds in the tab showing ``view`` drawn; found again if a redraw replaced it.

    ``dispatch``: send a DOM click event (SVG markers) instead of WebDriver's click. A stale element is
    refused before any click reaches the page, so a click is never sent twice.
    """

    def attempt(d: WebDriver) -> bool:
        if drawn(d, view) is None:
            return False
        element = find(d)
        if element is None:
            return False
        if dispatch:
            d.execute_script("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", element)
        else:
            element.click()
        return True

    wait(driver, attempt)


def css(selector: str, index: int = 0) -> Finder:
    """A finder: the ``index``-th element that ``selector`` matches, none while there are fewer."""

    def find(driver: WebDriver) -> WebElement | None:
        found = driver.find_elements(By.CSS_SELECTOR, selector)
        return found[index] if len(found) > index else None

    return find


def row_at_step(step: int) -> Finder:
    """A finder: the incident list's row of ``step``."""

    def find(driver: WebDriver) -> WebElement | None:
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.incident-row")
        return next((r for r in rows if r.find_element(By.CSS_SELECTOR, "td").text == str(step)), None)

    return find


def texts(element: WebDriver | WebElement, selector: str) -> list[str]:
    return [e.text for e in element.find_elements(By.CSS_SELECTOR, selector)]


def heading(driver: WebDriver) -> tuple[str | None, str]:
    """``(run, heading)`` of the incident shown."""
    incident = driver.find_element(By.CSS_SELECTOR, ".incident")
    return incident.get_attribute("data-run"), incident.find_element(By.TAG_NAME, "h3").text


def values(incident: WebElement, selector: str) -> list[str]:
    return texts(incident, f"{selector} .v")


def show(driver: WebDriver, view: str) -> None:
    """Switch the tab to ``view`` (its button in the header) and wait until the view is drawn."""

    def press(d: WebDriver) -> bool:
        d.find_element(By.CSS_SELECTOR, f".tabs button[data-view={view}]").click()
        return True

    wait(driver, press)
    wait(driver, lambda d: drawn(d, view))


def open_tab(server: TensorBoardServer, browser: WebDriver) -> WebDriver:
    """TensorBoard opened on the NanGuard tab, the driver switched into the tab's iframe, the timeline drawn."""
    browser.switch_to.default_content()
    browser.get("about:blank")  # a fresh page: the same URL with a hash would not reload the tab
    browser.get(f"{server.url}/#nanguard")

    def inside_drawn_tab(d: WebDriver) -> bool:
        d.switch_to.default_content()
        frames = d.find_elements(By.CSS_SELECTOR, "iframe")
        if not frames:
            return False
        d.switch_to.frame(frames[0])  # stale or gone if TensorBoard replaced the frame meanwhile: looked up again
        return drawn(d, "timeline") is not None

    wait(browser, inside_drawn_tab)
    return browser


@pytest.fixture
def tab(server: TensorBoardServer, browser: WebDriver) -> WebDriver:
    """TensorBoard opened on the NanGuard tab, the driver switched into the tab's iframe."""
    return open_tab(server, browser)


# ------------------------------------------------------------------------------------ tests


def test_tab_is_in_tensorboards_header(server: TensorBoardServer, browser: WebDriver) -> None:
    browser.switch_to.default_content()
    browser.get(f"{server.url}/#nanguard")
    # the tab's name in TensorBoard's header and the tab's frame, both in one look
    wait(
        browser,
        lambda d: (
            "NANGUARD" in d.find_element(By.TAG_NAME, "body").text.upper()
            and d.find_elements(By.CSS_SELECTOR, "iframe")
        ),
    )


def read_timeline(driver: WebDriver) -> dict[str, Any]:
    return {
        "cards": [
            {
                "run": card.get_attribute("data-run"),
                "markers": [
                    (m.get_attribute("data-step"), m.get_attribute("class"))
                    for m in card.find_elements(By.CSS_SELECTOR, "g.marker")
                ],
                "text": card.text,
                "labels": texts(card, "text.panel-label"),
                "grad": [p.get_attribute("d") for p in card.find_elements(By.CSS_SELECTOR, "path.series.grad")],
            }
            for card in driver.find_elements(By.CSS_SELECTOR, ".timeline-card")
        ],
        "legends": texts(driver, ".legend"),
    }


def test_timeline_shows_every_incident_of_every_selected_run(tab: WebDriver, tmp_path: Path) -> None:
    timeline = look(tab, "timeline", read_timeline)
    cards = timeline["cards"]
    assert [card["run"] for card in cards] == list(ALL_RUNS)  # side by side, one per run
    for card in (cards[0], cards[2]):
        assert [step for step, _ in card["markers"]] == ["1", "3", "5", "7"]
        assert "4 incidents at 4 steps" in card["text"]
        labels = card["labels"]
        assert labels[0].startswith("gradient norm") and labels[1].startswith("train_loss")
        assert card["grad"] and card["grad"][0].startswith("M")
    assert "NaN/Inf" in timeline["legends"][0]
    mixed = cards[1]
    assert [kind for _, kind in mixed["markers"]] == ["marker g-nonfinite", "marker g-spike"]
    assert "no finite values logged" in mixed["text"]  # a run without TensorBoard scalars still has its markers
    tab.save_screenshot(str(tmp_path / "timeline.png"))


def test_clicking_a_marker_opens_the_incident(tab: WebDriver) -> None:
    click(tab, "timeline", css(f".timeline-card[data-run='{RUNS[1]}'] g.marker", 2), dispatch=True)
    assert look(tab, "incidents", heading) == (RUNS[1], "Step 5")


def test_incident_view_shows_samples_source_and_bundle(tab: WebDriver) -> None:
    show(tab, "incidents")

    def read(d: WebDriver) -> dict[str, Any]:
        incident = d.find_element(By.CSS_SELECTOR, ".incident")
        culprits = incident.find_elements(By.CSS_SELECTOR, ".code-line.culprit")
        images = incident.find_elements(By.CSS_SELECTOR, ".thumb img")
        return {
            "rows": [(texts(row, "td")[0], row.text) for row in d.find_elements(By.CSS_SELECTOR, "tr.incident-row")],
            "step": incident.find_element(By.TAG_NAME, "h3").text,
            "culprit": [(texts(c, ".ln"), texts(c, ".code")) for c in culprits],
            "code_lines": len(incident.find_elements(By.CSS_SELECTOR, ".code-line")),
            "files": texts(incident, ".file"),
            "image_width": [
                d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) for image in images
            ],
            "captions": texts(incident, ".thumb figcaption"),
            "text": incident.text,
        }

    # the first incident, read once its thumbnail has loaded
    shown = look(tab, "incidents", read, until=lambda s: s["image_width"][:1] == [12])
    rows = shown["rows"]
    assert [step for step, _ in rows] == ["1", "3", "5", "7"]
    assert "step skipped" in rows[0][1] and f"idx {BLANK[0]}" in rows[0][1]
    assert shown["step"] == "Step 1"
    (line, code), *_ = shown["culprit"]
    assert line == [str(origin_line())]
    assert [c.strip() for c in code] == ["return dot / patch_norm  # DASHBOARD-ORIGIN"]
    assert shown["code_lines"] == 11  # the line and 5 either side
    assert f"dashboard_runs.py:{origin_line()}" in shown["files"][0]
    assert f"index {BLANK[0]}" in shown["captions"][0]
    assert "bundle pruned" in shown["text"]
    assert "DivBackward0" in shown["text"] and "net.0" in shown["text"]

    click(tab, "incidents", css("tr.incident-row", 3))
    _, commands = look(
        tab, "incidents", lambda d: (heading(d)[1], texts(d, "pre.command")), until=lambda s: s[0] == "Step 7"
    )
    assert commands[0].startswith("python -m lightning_nanguard replay ") and commands[0].endswith("step-7")


def test_summary_side_by_side(tab: WebDriver) -> None:
    show(tab, "summary")

    def read(d: WebDriver) -> list[dict[str, Any]]:
        return [
            {
                "run": card.get_attribute("data-run"),
                "tiles": texts(card, ".tile-value"),
                "ranked": [
                    (table.text, [texts(row, "td") for row in table.find_elements(By.CSS_SELECTOR, "tbody tr")])
                    for table in card.find_elements(By.CSS_SELECTOR, "table.ranked")
                ],
                "lost": texts(card, ".lost"),
            }
            for card in d.find_elements(By.CSS_SELECTOR, ".summary-card")
        ]

    cards = look(tab, "summary", read)
    assert [card["run"] for card in cards] == list(ALL_RUNS)
    assert cards[1]["tiles"] == ["2", "1", "0", "0"]
    for card in (cards[0], cards[2]):
        assert card["tiles"] == ["4", "4", "2", "1"]  # incidents, skipped, dataset items, origins
        (_, indices), (origins, _) = card["ranked"][:2]
        assert [cells[0] for cells in indices] == [str(BLANK[0]), str(BLANK[1])]
        assert f"dashboard_runs.py:{origin_line()}" in origins
        assert "4 steps skipped" in card["lost"][0]


def card_runs(driver: WebDriver) -> list[str | None]:
    return [card.get_attribute("data-run") for card in driver.find_elements(By.CSS_SELECTOR, ".timeline-card")]


def test_run_selector(tab: WebDriver) -> None:
    boxes = ".run-list input[type=checkbox]"
    listed = look(
        tab, "timeline", lambda d: [b.get_attribute("value") for b in d.find_elements(By.CSS_SELECTOR, boxes)]
    )
    assert listed == list(ALL_RUNS)
    click(tab, "timeline", css(boxes, 0))
    # the timeline once the unselected run's card is gone
    assert look(tab, "timeline", card_runs, until=lambda runs: RUNS[0] not in runs) == list(ALL_RUNS[1:])
    click(tab, "timeline", css(boxes, 1))  # looked up in the redrawn list
    shown = look(tab, "timeline", card_runs, until=lambda runs: MIXED not in runs)
    assert shown == [RUNS[1], LOADERS_RUN, VERIFIED_RUN]


def pick_run(driver: WebDriver, run: str) -> None:
    """Show the incident list of ``run`` (the run picker), and wait until its incident is drawn."""
    click(driver, "incidents", css(f"select.run-picker option[value='{run}']"))
    look(driver, "incidents", heading, until=lambda shown: shown[0] == run)


def test_older_events_and_spikes_are_shown(tab: WebDriver) -> None:
    show(tab, "incidents")
    click(tab, "incidents", css(f"select.run-picker option[value='{MIXED}']"))

    def read_legacy(d: WebDriver) -> dict[str, Any]:
        incident = d.find_element(By.CSS_SELECTOR, ".incident")
        return {
            "shown": heading(d),
            "text": incident.text,
            "code_lines": len(incident.find_elements(By.CSS_SELECTOR, ".code-line")),
        }

    legacy = look(tab, "incidents", read_legacy, until=lambda s: s["shown"][0] == MIXED)
    assert legacy["shown"][1] == "Step 4"
    assert "net.1: channels [0, 2]" in legacy["text"] and "No repro bundle was saved" in legacy["text"]
    assert "The samples were not searched." in legacy["text"] and not legacy["code_lines"]

    click(tab, "incidents", css("tr.incident-row", 1))

    def read_spike(d: WebDriver) -> dict[str, Any]:
        incident = d.find_element(By.CSS_SELECTOR, ".incident")
        return {
            "shown": heading(d),
            "details": {
                row.find_element(By.CSS_SELECTOR, ".k").text: row.find_element(By.CSS_SELECTOR, ".v").text
                for row in incident.find_elements(By.CSS_SELECTOR, "[data-section='Other details'] .kv")
            },
            "chips": texts(incident, ".chip-spike"),
            "errors": texts(d, ".error"),
        }

    spike = look(tab, "incidents", read_spike, until=lambda s: s["shown"] == (MIXED, "Step 9"))
    assert spike["details"] == {"threshold": "40", "baseline": "2.1"}
    assert "loss_spike" in spike["chips"][0]
    assert not spike["errors"]


def test_several_loaders_are_named_in_the_list_the_incident_and_the_summary(tab: WebDriver) -> None:
    show(tab, "incidents")
    click(tab, "incidents", css(f"select.run-picker option[value='{LOADERS_RUN}']"))

    def read_incident(d: WebDriver) -> dict[str, Any]:
        incident = d.find_element(By.CSS_SELECTOR, ".incident")
        loaders = incident.find_elements(By.CSS_SELECTOR, ".kv.loader")
        return {
            "run": incident.get_attribute("data-run"),
            "rows": texts(d, "tr.incident-row"),
            "loaders": {e.get_attribute("data-loader"): e.text for e in loaders},
            "text": incident.text,
        }

    shown = look(tab, "incidents", read_incident, until=lambda s: s["run"] == LOADERS_RUN)
    assert "idx a:13, b:6" in shown["rows"][0] and "idx b:9" in shown["rows"][1]
    assert "positions [5] of 8 · dataset indices [13]" in shown["loaders"]["a"]
    assert "positions [2] of 4 · dataset indices [6]" in shown["loaders"]["b"]
    assert "loader_batch_sizes" not in shown["text"]  # shown with the samples, not under "other details"

    show(tab, "summary")

    def read_table(d: WebDriver) -> tuple[list[str], list[list[str]]]:
        table = d.find_element(By.CSS_SELECTOR, f".summary-card[data-run='{LOADERS_RUN}'] table.ranked")
        return texts(table, "th"), [texts(tr, "td")[:2] for tr in table.find_elements(By.CSS_SELECTOR, "tbody tr")]

    headers, cells = look(tab, "summary", read_table)
    assert headers[:2] == ["loader", "dataset index"]
    assert cells == [["b", "6"], ["b", "9"], ["a", "13"]]


def open_incident(driver: WebDriver, run: str, step: int, read: Callable[[WebElement], Any]) -> Any:
    """Open the incident of ``run`` at ``step`` from the incident list; ``read(incident element)`` once it is drawn."""
    show(driver, "incidents")
    if look(driver, "incidents", heading)[0] != run:
        pick_run(driver, run)
    click(driver, "incidents", row_at_step(step))

    def read_drawn(d: WebDriver) -> tuple[tuple[str | None, str], Any]:
        return heading(d), read(d.find_element(By.CSS_SELECTOR, ".incident"))

    return look(driver, "incidents", read_drawn, until=lambda s: s[0] == (run, f"Step {step}"))[1]


def test_what_the_guard_verified_is_marked_in_the_list_the_incident_and_the_summary(tab: WebDriver) -> None:
    def read_verified(incident: WebElement) -> dict[str, Any]:
        rows = [r.find_elements(By.TAG_NAME, "td") for r in tab.find_elements(By.CSS_SELECTOR, "tr.incident-row")]
        return {
            "rows": [([td.text for td in r], r[4].get_attribute("class")) for r in rows],
            "indices": values(incident, ".kv.indices"),
            "blame": values(incident, ".kv.blame"),
            "marked": len(incident.find_elements(By.CSS_SELECTOR, ".mark-verified")),
            "doubted": len(incident.find_elements(By.CSS_SELECTOR, ".mark-unverified")),
            "details": len(incident.find_elements(By.CSS_SELECTOR, "[data-section='Other details']")),
        }

    verified = open_incident(tab, VERIFIED_RUN, 2, read_verified)
    rows = verified["rows"]
    assert [cells[4] for cells, _ in rows] == ["idx 27, 29", "idx 27, 31 (not verified)", "idx [10, 11], [40]", ""]
    assert ["mark-unverified" in samples_class for _, samples_class in rows] == [False, True, False, False]
    assert [cells[2] for cells, _ in rows] == ["data", "data", "data", "batch"]
    assert verified["indices"] == ["[27, 29] (verified)"]
    assert verified["blame"] == ["verified: bad beside known-healthy samples (+1 pass)"]
    assert verified["marked"] == 2
    assert not verified["doubted"]
    assert not verified["details"]  # verify_passes is shown

    def read_doubted(incident: WebElement) -> dict[str, Any]:
        return {
            "indices": values(incident, ".kv.indices"),
            "blame": values(incident, ".kv.blame"),
            "doubted": len(incident.find_elements(By.CSS_SELECTOR, ".mark-unverified")),
            "text": incident.text,
        }

    doubted = open_incident(tab, VERIFIED_RUN, 4, read_doubted)
    assert doubted["indices"] == [f"[27, 31] (not verified: {UNVERIFIED_INDICES})"]
    assert doubted["blame"] == [f"not verified: {UNVERIFIED_BLAME}"]
    assert doubted["doubted"] == 2
    assert "indices_unverified" not in doubted["text"] and "blame_unverified" not in doubted["text"]

    def read_packed(incident: WebElement) -> dict[str, Any]:
        return {
            "records": values(incident, ".kv.records"),
            "blame": values(incident, ".kv.blame"),
            "captions": [text.split("\n")[0] for text in texts(incident, ".thumb figcaption")],
        }

    packed = open_incident(tab, VERIFIED_RUN, 6, read_packed)
    assert packed["records"] == ["#1: [10, 11] · #6: [40] (verified)"]
    assert packed["blame"] == [f"verified: bad beside known-healthy samples (+1 pass); {BLAME_NOTE}"]
    assert packed["captions"] == ["#1 · records 10, 11", "#6 · records 40"]

    def read_batch(incident: WebElement) -> dict[str, Any]:
        chips = incident.find_elements(By.CSS_SELECTOR, ".chip-cause")
        return {
            "chips": [(chip.text, chip.get_attribute("title")) for chip in chips],
            "text": incident.text,
            "hints": texts(incident, ".hint"),
            "named": len(incident.find_elements(By.CSS_SELECTOR, ".kv.blame, .kv.indices")),
        }

    batch = open_incident(tab, VERIFIED_RUN, 8, read_batch)
    chip_text, chip_title = batch["chips"][0]
    assert chip_text == "cause: batch" and chip_title.startswith("the batch as a whole, no record is at fault")
    assert "The batch as a whole is at fault: no record is named, nothing is quarantined." in batch["text"]
    assert "Cause: batch (the batch as a whole, no record is at fault" in batch["text"]
    assert batch["hints"][0] == BATCH_HINT
    assert not batch["named"]

    show(tab, "summary")

    def read_summary(d: WebDriver) -> dict[str, Any]:
        card = d.find_element(By.CSS_SELECTOR, f".summary-card[data-run='{VERIFIED_RUN}']")
        table = card.find_element(By.CSS_SELECTOR, "table.ranked")
        return {
            "causes": {
                texts(row, ".bar-label")[0]: texts(row, ".bar-count")[0]
                for row in card.find_elements(By.CSS_SELECTOR, "[data-section='By cause'] .bar-row")
            },
            "headers": texts(table, "th"),
            "cells": [texts(tr, "td") for tr in table.find_elements(By.CSS_SELECTOR, "tbody tr")],
        }

    summary = look(tab, "summary", read_summary)
    assert summary["causes"] == {"data": "3", "batch": "1"}
    assert summary["headers"] == ["dataset index", "incidents", "steps", "checked"]
    assert [(c[0], c[3]) for c in summary["cells"]] == [
        ("27", "not verified"),
        ("10", "verified"),
        ("11", "verified"),
        ("29", "verified"),
        ("31", "not verified"),
        ("40", "verified"),
    ]


def timeline_now(driver: WebDriver) -> dict[str, Any]:
    """What the timeline shows, read in one script.

    ``{"counts": {run: incident count in the run list}, "steps": {run: steps of the markers in its card}}``.
    """
    return driver.execute_script(
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
        before = look(tab, "timeline", timeline_now)
        assert before["counts"][MIXED] == "2" and "99" not in before["steps"][MIXED]
        with events.open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(dict(SPIKE_EVENT, global_step=99, batch_idx=99)) + "\n")
        # waits for the new marker itself (step 99 in the run's card); the run list's count is read from the
        # same drawn timeline, the redraw that drew the marker
        after = look(tab, "timeline", timeline_now, until=lambda now: "99" in now["steps"].get(MIXED, []), timeout=30)
        assert after["counts"][MIXED] == "3"
        assert after["counts"][RUNS[0]] == "4"  # the other runs are untouched
    finally:
        events.write_text(original, encoding="utf-8")
        tab.execute_script("window.localStorage.removeItem('nanguard.pollSeconds');")


def test_no_errors_in_the_browser_console(tab: WebDriver) -> None:
    for view in ("incidents", "summary", "timeline"):
        show(tab, view)
    assert not look(tab, "timeline", lambda d: texts(d, ".error"))
    severe = [e for e in tab.get_log("browser") if e["level"] == "SEVERE" and "nanguard" in e["message"]]
    assert severe == []
