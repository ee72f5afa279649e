"""The NanGuard TensorBoard plugin's routes, against a real TensorBoard server over real guarded runs.

One log directory per module: a guarded image run in each Lightning namespace, a synthetic large
run written by the real ``JsonlEventLog`` (several ranks, a half-written last line), and one
TensorBoard process started on 127.0.0.1 with a free port.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dashboard_runs import (
    BLANK,
    LEGACY_EVENT,
    LOADERS_RUN,
    VERIFIED_RUN,
    TensorBoardServer,
    guarded_image_run,
    guarded_loaders_run,
    origin_line,
    tensorboard_server,
    verified_events,
    wait_for,
    write_mixed_run,
    write_verified_run,
)
from event_factory import make_event
from png_reader import decode_png
from werkzeug.test import Client

from lightning_nanguard import NanEvent, NanGuard
from lightning_nanguard.reporting.jsonl import EVENTS_FILENAME as WRITER_EVENTS_FILENAME
from lightning_nanguard.reporting.jsonl import JsonlEventLog
from lightning_nanguard_tensorboard import NanGuardLoader
from lightning_nanguard_tensorboard.layout import EVENTS_FILENAME, INCIDENTS_DIRNAME
from lightning_nanguard_tensorboard.plugin import NanGuardPlugin

LARGE = "large/version_0"
LARGE_EVENTS = 3000


@dataclass
class Served:
    logdir: Path
    server: TensorBoardServer
    runs: dict[str, tuple[Path, NanGuard]]

    def json(self, path: str) -> Any:
        status, _, body = self.server.get(path)
        assert status == 200, (path, status, body[:300])
        return json.loads(body)


def write_large_run(run_dir: Path) -> list[NanEvent]:
    """3000 events of two ranks, appended out of order, then a half-written line (a live run)."""
    log = JsonlEventLog(run_dir / "nanguard" / "events.jsonl")
    events = []
    for i in range(LARGE_EVENTS):
        step, rank = (LARGE_EVENTS - i) // 2, i % 2
        kinds = ("loss_spike",) if i % 3 == 0 else ("grad",)
        events.append(
            make_event(
                bare=True,
                global_step=step,
                batch_idx=step,
                rank=rank,
                kinds=kinds,
                dataset_indices=(i % 7,),
                loss=1e3 + i,
            )
        )
        log.append(events[-1])
    with open(log.path, "a", encoding="utf-8") as handle:
        handle.write('{"global_step": 99999, "rank": 0, "kinds": ["lo')
    return events


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    logdir = tmp_path_factory.mktemp("logs")
    runs = {ns: guarded_image_run(ns, logdir) for ns in ("lightning", "pytorch_lightning")}
    write_large_run(logdir / "large" / "version_0")
    with tensorboard_server(logdir, tmp_path_factory.mktemp("tb")) as server:
        served = Served(logdir, server, runs)
        # TensorBoard loads event files in the background: wait for the scalars of both runs
        assert wait_for(
            lambda: all(served.json(f"/data/plugin/nanguard/timeline?run={ns}/version_0")["grad_norm"] for ns in runs)
        ), server.log.read_text(encoding="utf-8")
        yield served


def run_name(ns: str) -> str:
    return f"{ns}/version_0"


NAMESPACES = ("lightning", "pytorch_lightning")


# ------------------------------------------------------------------------------------ listing and runs


def test_plugin_is_listed_and_enabled(served: Served) -> None:
    listing = served.json("/data/plugins_listing")
    assert listing["nanguard"]["enabled"] is True
    assert listing["nanguard"]["tab_name"] == "NanGuard"
    assert listing["nanguard"]["loading_mechanism"] == {
        "type": "IFRAME",
        "module_path": "/data/plugin/nanguard/static/index.js",
    }


def test_runs_are_named_as_tensorboard_names_them(served: Served) -> None:
    tensorboard_runs = set(served.json("/data/runs"))
    ours = {r["run"]: r for r in served.json("/data/plugin/nanguard/runs")}
    assert set(ours) == {run_name(ns) for ns in NAMESPACES} | {LARGE}
    assert {run_name(ns) for ns in NAMESPACES} <= tensorboard_runs  # the same names as TensorBoard's
    for ns in NAMESPACES:
        assert ours[run_name(ns)]["incidents"] == len(served.runs[ns][1].events) == 4
        assert (ours[run_name(ns)]["first_step"], ours[run_name(ns)]["last_step"]) == (1, 7)
        assert ours[run_name(ns)]["precursors"] == 0  # early warnings among the events (none in these runs)
    assert ours[LARGE]["incidents"] == LARGE_EVENTS  # the half-written last line is not an event


def test_static_frontend_is_served_and_needs_no_network(served: Served) -> None:
    status, headers, body = served.server.get("/data/plugin/nanguard/static/index.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert b"export async function render()" in body
    static = Path(__file__).resolve().parents[2] / "lightning_nanguard_tensorboard" / "static"
    for path in static.iterdir():
        text = path.read_text(encoding="utf-8")
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text, path.name
        assert served.server.get(f"/data/plugin/nanguard/static/{path.name}")[0] == 200
    assert served.server.get("/data/plugin/nanguard/static/..%2F__init__.py")[0] == 404
    assert served.server.get("/data/plugin/nanguard/static/plugin.py")[0] == 404


# ------------------------------------------------------------------------------------ incidents (the contract)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_incidents_are_the_events_jsonl_objects(served: Served, ns: str) -> None:
    run_dir, guard = served.runs[ns]
    incidents = served.json(f"/data/plugin/nanguard/incidents?run={run_name(ns)}")
    lines = (run_dir / "nanguard" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert [{k: v for k, v in e.items() if k != "_dashboard"} for e in incidents] == [json.loads(x) for x in lines]
    assert [e["global_step"] for e in incidents] == [1, 3, 5, 7]
    assert [e["loss"] for e in incidents] == ["nan"] * 4  # NaN/Inf as strings, as to_dict() writes them
    assert [e["dataset_indices"] for e in incidents] == [[BLANK[0]], [BLANK[1]], [BLANK[0]], [BLANK[1]]]
    assert [e["_dashboard"]["index"] for e in incidents] == [0, 1, 2, 3]
    # max_repro_bundles=1: only the last bundle is left
    assert [e["_dashboard"]["bundle"] for e in incidents] == ["pruned", "pruned", "pruned", "present"]
    assert all(e["_dashboard"]["context"] for e in incidents)
    assert incidents[0]["source_line"].endswith(f"dashboard_runs.py:{origin_line()}")
    assert guard.events[0].to_dict()["kinds"] == incidents[0]["kinds"]


def test_unknown_or_hostile_run_gives_an_empty_list(served: Served) -> None:
    for query in ("run=nope", "", "run=..", "run=../..", f"run={served.logdir}", "run=lightning"):
        status, _, body = served.server.get(f"/data/plugin/nanguard/incidents?{query}")
        assert (status, json.loads(body)) == (200, []), query
    assert served.server.get("/data/plugin/nanguard/incident?run=nope&index=0")[0] == 404
    assert served.server.get("/data/plugin/nanguard/incident?run=lightning/version_0&index=x")[0] == 400
    assert served.server.get("/data/plugin/nanguard/incident?run=lightning/version_0&index=99")[0] == 404


def test_large_run_is_sorted_and_paged(served: Served) -> None:
    everything = served.json(f"/data/plugin/nanguard/incidents?run={LARGE}")
    keys = [(e["global_step"], e["rank"]) for e in everything]
    assert len(everything) == LARGE_EVENTS and keys == sorted(keys)
    assert {e["rank"] for e in everything} == {0, 1}  # every rank's events are kept
    status, headers, body = served.server.get(f"/data/plugin/nanguard/incidents?run={LARGE}&offset=1000&limit=50")
    page = json.loads(body)
    assert status == 200 and headers["X-Total-Count"] == str(LARGE_EVENTS)
    assert page == everything[1000:1050]
    assert served.json(f"/data/plugin/nanguard/incidents?run={LARGE}&offset=2990&limit=50") == everything[2990:]
    assert served.server.get(f"/data/plugin/nanguard/incidents?run={LARGE}&offset=-1")[0] == 400
    timeline = served.json(f"/data/plugin/nanguard/timeline?run={LARGE}")
    assert len(timeline["markers"]) == LARGE_EVENTS and timeline["grad_norm"] == [] and timeline["loss"] is None


# ------------------------------------------------------------------------------------ one incident


@pytest.mark.parametrize("ns", NAMESPACES)
def test_incident_has_source_stack_thumbnails_and_bundle(served: Served, ns: str) -> None:
    first = served.json(f"/data/plugin/nanguard/incident?run={run_name(ns)}&index=0")
    assert first["event"]["global_step"] == 1 and first["event"]["_dashboard"]["index"] == 0
    source = first["context"]["source"]
    line = origin_line()
    assert source["line"] == line and source["file"].endswith("dashboard_runs.py")
    assert source["lines"][line - source["first_line"]].strip() == "return dot / patch_norm  # DASHBOARD-ORIGIN"
    (thumb,) = first["context"]["thumbnails"]
    assert (thumb["position"], thumb["dataset_index"]) == (BLANK[0] % 16, BLANK[0])
    assert first["bundle"] == {"status": "pruned", "name": "step-1"}

    status, headers, png = served.server.get(
        f"/data/plugin/nanguard/thumbnail?run={run_name(ns)}&index=0&position={thumb['position']}"
    )
    assert status == 200 and headers["Content-Type"] == "image/png"
    width, height, pixels = decode_png(png)
    assert (width, height) == (12, 12) and set(pixels) == {(0, 0, 0)}  # the blank image that made the NaN
    assert served.server.get(f"/data/plugin/nanguard/thumbnail?run={run_name(ns)}&index=0&position=3")[0] == 404

    last = served.json(f"/data/plugin/nanguard/incident?run={run_name(ns)}&index=3")
    bundle_dir = served.logdir / ns / "version_0" / "nanguard" / "step-7"
    assert last["bundle"]["status"] == "present"
    assert last["bundle"]["command"] == f"python -m lightning_nanguard replay {os.path.normpath(bundle_dir)}"


# ------------------------------------------------------------------------------------ timeline and summary


@pytest.mark.parametrize("ns", NAMESPACES)
def test_timeline_reads_the_runs_scalars(served: Served, ns: str) -> None:
    timeline = served.json(f"/data/plugin/nanguard/timeline?run={run_name(ns)}")
    assert [m["step"] for m in timeline["markers"]] == [1, 3, 5, 7]
    assert {m["action"] for m in timeline["markers"]} == {"skipped"}
    assert timeline["loss"]["tag"] == "train_loss" and timeline["loss_tags"] == ["train_loss"]
    loss_steps = [step for step, _ in timeline["loss"]["points"]]
    assert loss_steps and set(loss_steps) <= set(range(8))
    norms = dict(timeline["grad_norm"])
    assert norms and all(value is None or value > 0 for value in norms.values())
    assert timeline["step_range"][0] <= 1 and timeline["step_range"][1] == 7
    unknown_tag = served.json(f"/data/plugin/nanguard/timeline?run={run_name(ns)}&loss_tag=nanguard/grad_norm")
    assert unknown_tag["loss"]["tag"] == "train_loss"  # only loss-like tags of the run can be chosen


@pytest.mark.parametrize("ns", NAMESPACES)
def test_summary_ranks_dataset_indices_and_origins(served: Served, ns: str) -> None:
    summary = served.json(f"/data/plugin/nanguard/summary?run={run_name(ns)}")
    assert summary["incidents"] == 4 and summary["steps_skipped"] == 4
    assert summary["by_action"] == [["skipped", 4]]
    assert [{k: v for k, v in item.items() if k != "verified"} for item in summary["dataset_indices"]] == [
        {"index": BLANK[0], "count": 2, "steps": [1, 5]},
        {"index": BLANK[1], "count": 2, "steps": [3, 7]},
    ]
    assert all(item.get("verified", True) for item in summary["dataset_indices"])  # blank images: never doubted
    (origin,) = summary["origins"]
    assert origin["count"] == 4 and origin["source_line"].endswith(f"dashboard_runs.py:{origin_line()}")
    assert origin["module"] == "net.0" and origin["phase"] in ("forward", "backward")
    assert summary["last_logged_step"] == 7
    assert summary["skipped_total"] in (None, 4.0)


# ------------------------------------------------------------------------------------ in-process WSGI app


def plugin_client(logdir: Path) -> Client:
    context = SimpleNamespace(logdir=str(logdir), flags=SimpleNamespace(logdir=str(logdir)), data_provider=None)
    plugin = NanGuardPlugin(context)  # type: ignore[arg-type]
    apps = plugin.get_plugin_apps()

    def app(environ: Any, start_response: Any) -> Any:
        route = environ["PATH_INFO"]
        return apps["/static/*" if route.startswith("/static/") else route](environ, start_response)

    return Client(app)


def test_a_copied_log_directory_works_and_event_paths_are_never_opened(served: Served, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere"
    shutil.copytree(served.logdir / "lightning", copy / "lightning")
    client = plugin_client(copy)
    incident = client.get("/incident?run=lightning/version_0&index=0").json
    assert incident["context"]["source"]["line"] == origin_line()  # the source lines travelled with the run
    # the copy reads its own files only: without its incident directory there is no context, although
    # the original machine's (named in the event) still exists
    shutil.rmtree(copy / "lightning" / "version_0" / "nanguard" / INCIDENTS_DIRNAME / "step-1")
    assert client.get("/incident?run=lightning/version_0&index=0").json["context"] is None
    last = client.get("/incident?run=lightning/version_0&index=3").json
    assert last["event"]["repro_path"].startswith(str(served.logdir)) and Path(last["event"]["repro_path"]).is_dir()
    assert last["bundle"]["path"] == os.path.join(str(copy), "lightning", "version_0", "nanguard", "step-7")
    shutil.rmtree(copy / "lightning" / "version_0" / "nanguard" / "step-7")
    assert client.get("/incident?run=lightning/version_0&index=3").json["bundle"]["status"] == "pruned"


def test_symbolic_links_out_of_the_run_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "sample-0.png").write_bytes(b"\x89PNG secret")
    (secret / "context.json").write_text(json.dumps({"event": {"global_step": 1, "rank": 0, "epoch": 0}}))
    run = tmp_path / "logs" / "run"
    JsonlEventLog(run / "nanguard" / "events.jsonl").append(make_event(bare=True, global_step=1, batch_idx=1))
    (run / "nanguard" / INCIDENTS_DIRNAME).mkdir()
    os.symlink(secret, run / "nanguard" / INCIDENTS_DIRNAME / "step-1")
    client = plugin_client(tmp_path / "logs")
    assert client.get("/incident?run=run&index=0").json["context"] is None
    assert client.get("/thumbnail?run=run&index=0&position=0").status_code == 404


def test_layout_constants_match_the_writer() -> None:
    assert EVENTS_FILENAME == WRITER_EVENTS_FILENAME


# ------------------------------------------------------------------------------------ never in TensorBoard's way


def test_entry_point_imports_neither_torch_nor_lightning() -> None:
    code = (
        "import sys\n"
        "from importlib import metadata\n"
        "(ep,) = [e for e in metadata.entry_points().select(group='tensorboard_plugins') if e.name == 'nanguard']\n"
        "loader = ep.load()\n"
        "import lightning_nanguard_tensorboard.plugin\n"
        "heavy = [m for m in ('torch', 'lightning', 'pytorch_lightning', 'lightning_nanguard') if m in sys.modules]\n"
        "print(loader.__name__, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path.home())
    assert out.stdout.strip() == "NanGuardLoader []"


def test_a_failing_plugin_is_logged_and_tensorboard_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    class BrokenFlags:
        @property
        def logdir(self) -> str:
            raise OSError("the log directory cannot be read")

    context = SimpleNamespace(logdir=None, flags=BrokenFlags(), data_provider=None)
    assert NanGuardLoader().load(context) is None
    assert "the TensorBoard tab is disabled" in caplog.text


def test_missing_log_directory_means_inactive(tmp_path: Path) -> None:
    context = SimpleNamespace(logdir=str(tmp_path / "missing"), flags=SimpleNamespace(), data_provider=None)
    assert NanGuardPlugin(context).is_active() is False  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ older and newer event files


def test_older_and_newer_events_are_shown_as_they_are(tmp_path: Path) -> None:
    write_mixed_run(tmp_path / "mixed")
    client = plugin_client(tmp_path)
    incidents = client.get("/incidents?run=mixed").json
    assert [e["global_step"] for e in incidents] == [4, 9]  # sorted; foreign lines skipped
    assert {k: v for k, v in incidents[0].items() if k != "_dashboard"} == LEGACY_EVENT  # no key invented
    legacy = client.get("/incident?run=mixed&index=0").json
    assert legacy["context"] is None and legacy["bundle"] == {"status": "none", "name": "step-4"}
    spike = client.get("/incident?run=mixed&index=1").json["event"]
    assert spike["details"] == {"threshold": 40.0, "baseline": 2.1}
    summary = client.get("/summary?run=mixed").json
    assert summary["by_kind"] == [["grad", 1], ["loss", 1], ["loss_spike", 1]]
    assert summary["by_cause"] == [["not investigated", 2]]
    assert summary["steps_skipped"] == 1 and summary["origins"] == [] and summary["dataset_indices"] == []
    markers = client.get("/timeline?run=mixed").json["markers"]
    assert [(m["step"], m["kinds"], m["action"]) for m in markers] == [
        (4, ["loss", "grad"], "skipped"),
        (9, ["loss_spike"], "warned"),
    ]


def test_a_log_directory_that_is_the_run_itself(served: Served) -> None:
    """``tensorboard --logdir <run dir>``: TensorBoard calls the run "."."""
    client = plugin_client(served.logdir / "lightning" / "version_0")
    assert [r["run"] for r in client.get("/runs").json] == ["."]
    assert len(client.get("/incidents?run=.").json) == 4
    assert client.get("/incident?run=.&index=0").json["context"]["source"]["line"] == origin_line()


# ------------------------------------------------------------------------------------ several training loaders


def test_several_loaders_events_incident_and_summary_name_the_loader(tmp_path: Path) -> None:
    run_dir, guard = guarded_loaders_run(tmp_path)
    client = plugin_client(tmp_path)
    incidents = client.get(f"/incidents?run={LOADERS_RUN}").json
    assert [(e["sample_loaders"], e["offending_samples"], e["dataset_indices"]) for e in incidents] == [
        (["a", "b"], [5, 2], [13, 6]),
        (["b"], [1], [9]),
    ]
    expected = [dict(e.to_dict(), _dashboard=i["_dashboard"]) for e, i in zip(guard.events, incidents, strict=True)]
    assert incidents == expected
    incident = client.get(f"/incident?run={LOADERS_RUN}&index=0").json
    assert incident["event"]["details"]["loader_batch_sizes"] == [["a", 8], ["b", 4]]
    summary = client.get(f"/summary?run={LOADERS_RUN}").json
    assert [{k: v for k, v in item.items() if k != "verified"} for item in summary["dataset_indices"]] == [
        {"index": 6, "loader": "b", "count": 1, "steps": [1]},
        {"index": 9, "loader": "b", "count": 1, "steps": [2]},
        {"index": 13, "loader": "a", "count": 1, "steps": [1]},
    ]
    assert all(item.get("verified", True) for item in summary["dataset_indices"])
    assert run_dir.name == "version_0"


# ------------------------------------------------------------------------------------ what the guard verified


def test_verification_marks_records_and_the_batch_cause_reach_the_routes(tmp_path: Path) -> None:
    write_verified_run(tmp_path)
    client = plugin_client(tmp_path)
    incidents = client.get(f"/incidents?run={VERIFIED_RUN}").json
    assert [{k: v for k, v in e.items() if k != "_dashboard"} for e in incidents] == [
        e.to_dict() for e in verified_events()
    ]
    assert [(e.get("indices_verified"), e.get("blame_verified")) for e in incidents] == [
        (True, True),
        (False, False),
        (True, True),
        (None, None),  # cause "batch": nothing named, the keys are absent
    ]
    packed = client.get(f"/incident?run={VERIFIED_RUN}&index=2").json
    assert [(t["position"], t["dataset_index"], t["records"]) for t in packed["context"]["thumbnails"]] == [
        (1, None, [10, 11]),
        (6, None, [40]),
    ]
    summary = client.get(f"/summary?run={VERIFIED_RUN}").json
    assert summary["by_cause"] == [["data", 3], ["batch", 1]]
    assert [(i["index"], i["count"], i["verified"]) for i in summary["dataset_indices"]] == [
        (27, 2, False),  # verified at step 2, not at step 4
        (10, 1, True),  # a record of a packed row
        (11, 1, True),
        (29, 1, True),
        (31, 1, False),
        (40, 1, True),
    ]
    assert summary["dataset_indices_total"] == 6
    markers = client.get(f"/timeline?run={VERIFIED_RUN}").json["markers"]
    assert [m["cause"] for m in markers] == ["data", "data", "data", "batch"]


def test_a_precursor_marker_carries_its_module_signal_and_value(tmp_path: Path) -> None:
    """The timeline's precursor lane shows where and what; the incident view gets the event's details."""
    run_dir = tmp_path / "precursor" / "version_0"
    warning = make_event(
        bare=True,
        global_step=40,
        kinds=("precursor",),
        action="warned",
        culprit_module="blocks.1.attn",
        details={"signal": "attention_max_logit", "value": 312.4, "threshold": 50.0, "growth": 6.1},
    )
    JsonlEventLog(str(run_dir / "nanguard" / WRITER_EVENTS_FILENAME)).append(warning)
    client = plugin_client(tmp_path)
    timeline = json.loads(client.get("/timeline?run=precursor/version_0").get_data())
    (marker,) = timeline["markers"]
    assert (marker["kinds"], marker["module"], marker["signal"], marker["value"]) == (
        ["precursor"],
        "blocks.1.attn",
        "attention_max_logit",
        312.4,
    )
    incident = json.loads(client.get("/incident?run=precursor/version_0&index=0").get_data())
    assert incident["event"]["details"]["growth"] == 6.1
