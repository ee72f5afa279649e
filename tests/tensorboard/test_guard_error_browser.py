"""A ``guard_error`` event in the NanGuard tab, in a real headless browser over a real TensorBoard.

One real ``Trainer.fit`` with a ``TensorBoardLogger`` in which the guard's spike watch is broken (a
planted fault: the part fails at step 0 and is switched off) and one input of batch 3 is NaN. The test
reads the run's ``events.jsonl`` and asserts what the page shows from it: the guard error's blue marker
in the incident lane beside the NaN's red one, and the view clicking it opens (the part, the error,
where, what stops, and that NaN/Inf steps are still dropped), while the NaN incident opens as usual.
Skipped, with the reason, where chromium and chromedriver are not installed (as ``test_dashboard_browser.py``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_runs import TensorBoardServer, tensorboard_server, wait_for
from fault_models import EveryPartModule, nan_loader
from fitting import build_trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_nanguard import NanGuard
from lightning_nanguard.engine.step.spikes import SpikeWatch

# The page helpers (and the browser fixture) of the dashboard's browser test, beside this file. Importing it
# skips this module, with its reason, where there is no headless browser.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_dashboard_browser import browser, click, css, heading, look, open_tab, texts  # noqa: F401, I001

from selenium.webdriver.common.by import By  # after the skip above
from selenium.webdriver.remote.webdriver import WebDriver

RUN = "guarded/version_0"
SECTION = "The guard's own error"


def broken_spike_watch(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("planted fault in the spike watch")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def events(logdir: Path) -> dict[str, dict[str, Any]]:
    """The run's two events as ``events.jsonl`` holds them: ``{"error": ..., "nan": ...}``."""
    guard = NanGuard(verbose=False, precursors=False)
    logger = TensorBoardLogger(str(logdir), name="guarded", version=0)
    trainer = build_trainer("lightning", logdir, callbacks=[guard], logger=logger)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SpikeWatch, "check", broken_spike_watch)
        trainer.fit(EveryPartModule(), nan_loader(bad_batches=(3,)))
    lines = (Path(logger.log_dir) / "nanguard" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    written = [json.loads(line) for line in lines]
    assert [(e["global_step"], e["kinds"]) for e in written] == [
        (0, ["guard_error"]),
        (3, ["loss", "grad", "bn_stats"]),
    ]
    return {"error": written[0], "nan": written[1]}


@pytest.fixture(scope="module")
def server(
    logdir: Path, events: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TensorBoardServer]:
    with tensorboard_server(logdir, tmp_path_factory.mktemp("tb")) as tb:

        def loaded() -> bool:
            try:
                status, _, body = tb.get(f"/data/plugin/nanguard/timeline?run={RUN}")
            except OSError:  # a server still starting (refused, reset): asked again
                return False
            timeline = json.loads(body) if status == 200 else {}
            return bool(timeline.get("grad_norm") and len(timeline.get("markers", [])) == 2)

        assert wait_for(loaded), f"TensorBoard never served the run:\n{tb.log.read_text(encoding='utf-8')}"
        yield tb


@pytest.fixture
def tab(server: TensorBoardServer, browser: WebDriver) -> WebDriver:  # noqa: F811  (the imported fixture)
    return open_tab(server, browser)


READ_MARKERS = """
const card = document.querySelector(`.timeline-card[data-run="${arguments[0]}"]`);
return [...card.querySelectorAll('g.marker')].map((m) => ({step: m.dataset.step, class: m.getAttribute('class'),
  fill: getComputedStyle(m.querySelector('circle, rect, path') || m).fill}));
"""


def read_incident(driver: WebDriver) -> dict[str, Any]:
    incident = driver.find_element(By.CSS_SELECTOR, ".incident")
    rows = incident.find_elements(By.CSS_SELECTOR, f'[data-section="{SECTION}"] .kv')
    chip = driver.execute_script(
        "const c = document.querySelector('.incident .chip-guard'); return c && getComputedStyle(c).color;"
    )
    return {
        "shown": heading(driver),
        "chips": texts(incident, ".chips .chip"),
        "sections": [e.get_attribute("data-section") for e in incident.find_elements(By.CSS_SELECTOR, "section")],
        "rows": {r.find_element(By.CSS_SELECTOR, ".k").text: r.find_element(By.CSS_SELECTOR, ".v").text for r in rows},
        "chip_colour": chip,
    }


def test_the_guard_error_has_its_own_marker_and_view(tab: WebDriver, events: dict[str, Any]) -> None:
    error = events["error"]
    markers = look(tab, "timeline", lambda d: d.execute_script(READ_MARKERS, RUN))
    by_class = {m["class"]: m for m in markers}
    assert set(by_class) == {"marker g-guard", "marker g-nonfinite"}
    assert by_class["marker g-guard"]["step"] == "0" and by_class["marker g-nonfinite"]["step"] == "3"
    assert by_class["marker g-guard"]["fill"] != by_class["marker g-nonfinite"]["fill"]
    click(tab, "timeline", css(f".timeline-card[data-run='{RUN}'] g.marker.g-guard"), dispatch=True)
    shown = look(tab, "incidents", read_incident, until=lambda s: s["shown"] == (RUN, "Step 0"))
    assert shown["chips"] == ["guard_error", "applied (warn)"]
    assert shown["sections"] == [SECTION]
    d = error["details"]
    assert shown["rows"] == {
        "part": "spikes",
        "error": "RuntimeError('planted fault in the spike watch')",
        "where": d["where"],
        "stops": "finite loss and gradient-norm spikes are no longer flagged",
        "still guarded": "yes: NaN/Inf steps are still checked and dropped",
    }
    assert shown["chip_colour"] == by_class["marker g-guard"]["fill"]  # the chip in the colour of its marker


def test_the_nan_after_the_guard_error_opens_as_a_skipped_incident(tab: WebDriver, events: dict[str, Any]) -> None:
    nan = events["nan"]
    click(tab, "timeline", css(f".timeline-card[data-run='{RUN}'] g.marker.g-nonfinite"), dispatch=True)
    shown = look(tab, "incidents", read_incident, until=lambda s: s["shown"] == (RUN, "Step 3"))
    assert shown["chips"][-1] == "step skipped" and SECTION not in shown["sections"]
    assert shown["sections"][:3] == ["Action", "Offending samples", "Origin"]
    assert nan["action"] == "skipped"
