"""The NanGuard tab's precursor lane and precursor incident view, in a real headless browser over a real TensorBoard.

One real ``Trainer.fit`` with a ``TensorBoardLogger`` and ``NanGuard`` (precursors sampled every step) on a
tiny two-layer attention model: ``layers.1.attn``'s attention logits are scaled by a factor that doubles
every step from step 6 on, so its max logit runs away and the guard writes an early warning
(``kinds == ["precursor"]``, the step applied); one target of batch 3 is NaN, so the same run also has a
skipped NaN incident. The test reads the run's ``events.jsonl`` and asserts what the page shows from it:
the warning's marker in its own lane under the incident lane (the NaN's marker in the incident lane), its
tooltip, and the incident view that clicking it opens (module, signal and value as the page formats
numbers, the level, the growth since the earlier step, the attention entropy, the fixes).
Skipped, with the reason, where chromium and chromedriver are not installed (as ``test_dashboard_browser.py``).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from dashboard_runs import TensorBoardServer, tensorboard_server, wait_for
from fitting import build_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

# The page helpers (and the browser fixture) of the dashboard's browser test, beside this file. Importing it
# skips this module, with its reason, where there is no headless browser.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_dashboard_browser import browser, click, css, heading, look, open_tab, texts  # noqa: F401, I001

from selenium.webdriver.common.by import By  # after the skip above
from selenium.webdriver.remote.webdriver import WebDriver

RUN = "precursor/version_0"
DIM, SEQ, BATCH, STEPS = 8, 6, 4, 16
GROW_FROM = 6  # from this step on layers.1.attn's logits are scaled by 2 ** (step - GROW_FROM)
NAN_STEP = 3  # a target of this batch is NaN: a skipped incident (the attention logits stay finite)
NAN_INDEX = NAN_STEP * BATCH + 2  # the dataset index of that target's sample (no shuffling)
EARLY_WARNING = "Early warning: attention collapse ahead"


class GrowingAttention(nn.Module):
    """``softmax(scale * q @ k^T / sqrt(d)) @ v``: the probe sees the softmax; ``scale`` is set by the model."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        logits = self.scale * self.q(x) @ self.k(x).transpose(-2, -1) / math.sqrt(DIM)
        return torch.softmax(logits, dim=-1) @ self.v(x)


class GrowingModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.ModuleDict({"attn": GrowingAttention()}) for _ in range(2)])
        self.head = nn.Linear(DIM, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        self.layers[1]["attn"].scale = 2.0 ** max(0, self.global_step - GROW_FROM)
        for layer in self.layers:
            x = x + layer["attn"](x)
        loss = F.mse_loss(self.head(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def growing_run(logdir: Path) -> Path:
    """Fit :class:`GrowingModel` under NanGuard with a TensorBoardLogger; the run directory (``logdir/RUN``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, SEQ, DIM, generator=g)
    y = torch.randn(STEPS * BATCH, SEQ, generator=g)
    y[NAN_INDEX] = float("nan")
    guard = NanGuard(
        verbose=False,
        precursor_max_cost=None,
        precursor_every_n_steps=1,
        precursor_min_logit=20.0,
        precursor_growth=4.0,
        precursor_window=4,
    )
    logger = pl.loggers.TensorBoardLogger(str(logdir), name="precursor", version=0)
    trainer = build_trainer("lightning", logdir, callbacks=[guard], logger=logger)
    trainer.fit(GrowingModel(), DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return Path(logger.log_dir)


def page_number(value: Any) -> str:
    """A number as the page writes it (``num`` of ``static/dom.js``): 4 significant digits, ties rounded up.

    JavaScript rounds the double's exact value, a tie away from zero (``toPrecision``, ``toExponential``);
    the examples are what chromium's ``num`` gives.

    Example:
        >>> [page_number(v) for v in (20.0, 1234, 21.613391876220703, 1.0625, 0.00012345, 123456.7, 99999.9, "nan")]
        ['20', '1,234', '21.61', '1.063', '1.234e-4', '1.235e+5', '100000', 'nan']
    """
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    if float(value).is_integer():
        return f"{int(value):,}"
    exact = Decimal(value)
    rounded = exact.quantize(Decimal(1).scaleb(exact.adjusted() - 3), rounding=ROUND_HALF_UP)
    if abs(value) < 1e-3 or abs(value) >= 1e5:
        return f"{rounded.scaleb(-rounded.adjusted()):.3f}e{rounded.adjusted():+d}"
    short = float(rounded)
    return str(int(short)) if short.is_integer() else repr(short)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def events(logdir: Path) -> dict[str, dict[str, Any]]:
    """The run's two events as ``events.jsonl`` holds them: ``{"warning": ..., "nan": ...}``."""
    run_dir = growing_run(logdir)
    lines = (run_dir / "nanguard" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    written = [json.loads(line) for line in lines]
    warnings = [e for e in written if e["kinds"] == ["precursor"]]
    nans = [e for e in written if e["kinds"] != ["precursor"]]
    assert len(warnings) == 1 and len(nans) == 1, written  # the run the tests below read
    (warning,), (nan,) = warnings, nans
    assert warning["action"] == "warned" and warning["culprit_module"] == "layers.1.attn"
    assert warning["global_step"] > GROW_FROM and nan["global_step"] == NAN_STEP and nan["action"] == "skipped"
    return {"warning": warning, "nan": nan}


@pytest.fixture(scope="module")
def server(
    logdir: Path, events: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TensorBoardServer]:
    with tensorboard_server(logdir, tmp_path_factory.mktemp("tb")) as tb:

        def loaded() -> bool:  # the scalars too, so the chart's panels (and the lanes under them) stay put
            try:
                status, _, body = tb.get(f"/data/plugin/nanguard/timeline?run={RUN}")
            except OSError:  # a server still starting (refused, reset): asked again
                return False
            timeline = json.loads(body) if status == 200 else {}
            return bool(timeline.get("grad_norm") and timeline.get("loss") and len(timeline.get("markers", [])) == 2)

        assert wait_for(loaded), f"TensorBoard never served the run:\n{tb.log.read_text(encoding='utf-8')}"
        yield tb


@pytest.fixture
def tab(server: TensorBoardServer, browser: WebDriver) -> WebDriver:  # noqa: F811  (the imported fixture)
    """TensorBoard opened on the NanGuard tab, the driver switched into the tab's iframe."""
    return open_tab(server, browser)


READ_CHART = """
const card = document.querySelector(`.timeline-card[data-run="${arguments[0]}"]`);
const box = (r) => {
  const top = Number(r.getAttribute('y'));
  return {top, bottom: top + Number(r.getAttribute('height'))};
};
return {
  lanes: [...card.querySelectorAll('rect.lane')].map((r) => ({class: r.getAttribute('class'), ...box(r)})),
  labels: [...card.querySelectorAll('text.panel-label')].map((t) => t.textContent),
  markers: [...card.querySelectorAll('g.marker')].map((m) => {
    const b = m.getBBox();
    return {step: m.dataset.step, class: m.getAttribute('class'), x: b.x + b.width / 2, y: b.y + b.height / 2,
      title: m.querySelector('title').textContent};
  }),
  guides: [...card.querySelectorAll('line.guide')].map((l) => l.getAttribute('class')),
  head: card.querySelector('.card-head .muted').textContent,
  count: document.querySelector(`.run-list label[title="${arguments[0]}"] .count`).textContent,
  warnings: document.querySelector(`.run-list label[title="${arguments[0]}"] .count-precursor`)?.textContent,
  legend: card.querySelector('.legend').textContent,
};
"""


def test_the_warning_sits_in_its_own_lane_under_the_incidents(tab: WebDriver, events: dict[str, Any]) -> None:
    warning, nan = events["warning"], events["nan"]
    chart = look(tab, "timeline", lambda d: d.execute_script(READ_CHART, RUN))
    lanes = {lane["class"]: lane for lane in chart["lanes"]}
    assert set(lanes) == {"panel-bg lane", "panel-bg lane precursor-lane"}
    incidents, precursors = lanes["panel-bg lane"], lanes["panel-bg lane precursor-lane"]
    assert incidents["bottom"] < precursors["top"]  # the warnings' lane under the incidents' lane
    assert chart["labels"][-2:] == ["incidents", "precursors"]

    def inside(marker: dict[str, Any], lane: dict[str, float]) -> bool:
        return lane["top"] < marker["y"] < lane["bottom"]

    markers = {marker["class"]: marker for marker in chart["markers"]}
    assert len(chart["markers"]) == 2 and set(markers) == {"marker g-precursor", "marker g-nonfinite"}
    early, skipped = markers["marker g-precursor"], markers["marker g-nonfinite"]
    assert early["step"] == str(warning["global_step"]) and skipped["step"] == str(nan["global_step"])
    assert inside(early, precursors) and not inside(early, incidents)
    assert inside(skipped, incidents) and not inside(skipped, precursors)
    assert skipped["x"] < early["x"]  # on the same step axis: step 3 left of the warning's step
    d = warning["details"]
    assert early["title"] == (
        f"step {warning['global_step']} · early warning in {warning['culprit_module']}: "
        f"{d['signal']} {page_number(d['value'])} · step applied (click to open)"
    )
    assert chart["guides"] == ["guide g-nonfinite"]  # no dashed line through the curves for a warning
    # incidents and early warnings are counted apart, in the card and in the run list
    assert chart["head"] == "1 incident at 1 step"
    assert (chart["count"], chart["warnings"]) == ("1", "+1")
    assert "early warning (the step was applied)" in chart["legend"]  # the triangle is explained


def test_the_chart_stays_inside_its_card_when_the_window_narrows(tab: WebDriver) -> None:
    look(tab, "timeline", lambda d: d.execute_script(READ_CHART, RUN))
    size = tab.get_window_size()
    overhang = (
        f"const card = document.querySelector('.timeline-card[data-run=\"{RUN}\"]');"
        "return card.querySelector('svg.timeline-chart').getBoundingClientRect().right"
        " - card.getBoundingClientRect().right;"
    )
    try:
        tab.set_window_size(size["width"] - 300, size["height"])  # drawn for the wider window; not drawn again
        assert look(tab, "timeline", lambda d: d.execute_script(overhang)) <= 0
    finally:
        tab.set_window_size(size["width"], size["height"])


def read_incident(driver: WebDriver) -> dict[str, Any]:
    incident = driver.find_element(By.CSS_SELECTOR, ".incident")
    rows = incident.find_elements(By.CSS_SELECTOR, f"[data-section='{EARLY_WARNING}'] .kv")
    return {
        "shown": heading(driver),
        "where": incident.find_element(By.CSS_SELECTOR, ".incident-head .muted").text,
        "chips": texts(incident, ".chips .chip"),
        "sections": [e.get_attribute("data-section") for e in incident.find_elements(By.CSS_SELECTOR, "section")],
        "rows": {r.find_element(By.CSS_SELECTOR, ".k").text: r.find_element(By.CSS_SELECTOR, ".v").text for r in rows},
        "fixes": texts(incident, f"[data-section='{EARLY_WARNING}'] li"),
        "text": incident.text,
        "list": [
            (texts(r, "td"), r.get_attribute("class")) for r in driver.find_elements(By.CSS_SELECTOR, "tr.incident-row")
        ],
        "colours": driver.execute_script(
            "const chip = document.querySelector('.incident .chip-precursor');"
            "const marker = document.createElementNS('http://www.w3.org/2000/svg', 'g');"
            "marker.setAttribute('class', 'marker g-precursor');"
            "document.body.appendChild(marker);"
            "const colours = [chip && getComputedStyle(chip).color, getComputedStyle(marker).fill];"
            "marker.remove();"
            "return colours;"
        ),
    }


def test_clicking_the_warning_opens_its_early_warning(tab: WebDriver, events: dict[str, Any]) -> None:
    warning, nan = events["warning"], events["nan"]
    step, d = warning["global_step"], warning["details"]
    click(tab, "timeline", css(f".timeline-card[data-run='{RUN}'] g.marker.g-precursor"), dispatch=True)
    shown = look(tab, "incidents", read_incident, until=lambda s: s["shown"] == (RUN, f"Step {step}"))
    assert shown["where"] == f"epoch {warning['epoch']} · batch {warning['batch_idx']} · rank 0"
    assert shown["chips"] == ["precursor", "applied (warn)"]
    assert shown["sections"] == [EARLY_WARNING]  # no samples, origin, repro or tensors: nothing was NaN
    assert shown["rows"] == {
        "module": warning["culprit_module"],
        "signal": f"attention max logit {page_number(d['value'])} (level {page_number(d['threshold'])})",
        "growth": f"{page_number(d['growth'])}x since step {d['earlier_step']} ({page_number(d['earlier_value'])})",
        "attention entropy": f"{page_number(d['entropy'])} nats (min-entropy bound {page_number(d['min_entropy'])})",
    }
    assert shown["fixes"] == d["fixes"] and any("QK-layernorm" in fix for fix in shown["fixes"])
    assert "No NaN yet: the step was applied." in shown["text"]
    # the incident list: both events by step, the warning's row open
    assert shown["list"] == [
        (
            [str(nan["global_step"]), ", ".join(nan["kinds"]), nan["cause"], "step skipped", f"idx {NAN_INDEX}"],
            "incident-row",
        ),
        ([str(step), "precursor", "", "applied (warn)", ""], "incident-row open"),
    ]
    chip, marker = shown["colours"]
    assert chip == marker  # the kind's chip in the colour of its marker


def test_the_nan_marker_opens_an_incident_not_a_warning(tab: WebDriver, events: dict[str, Any]) -> None:
    nan = events["nan"]
    click(tab, "timeline", css(f".timeline-card[data-run='{RUN}'] g.marker.g-nonfinite"), dispatch=True)
    shown = look(tab, "incidents", read_incident, until=lambda s: s["shown"] == (RUN, f"Step {nan['global_step']}"))
    assert shown["chips"] == [*nan["kinds"], f"cause: {nan['cause']}", "step skipped"]
    assert EARLY_WARNING not in shown["sections"] and not shown["rows"] and not shown["fixes"]
    assert shown["sections"][:3] == ["Action", "Offending samples", "Origin"]
