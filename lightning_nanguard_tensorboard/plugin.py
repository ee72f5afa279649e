"""The TensorBoard plugin: routes under ``/data/plugin/nanguard/`` and the static frontend.

Routes (``run`` is a run name as TensorBoard gives it; an unknown run gives an empty answer):

- ``runs``: ``[{"run", "incidents", "precursors", "first_step", "last_step"}]``, the runs with NanGuard
  events (``incidents`` counts every event, ``precursors`` the early warnings among them);
- ``incidents?run=RUN[&offset=K&limit=N]``: the run's events exactly as ``events.jsonl`` holds
  them plus ``"_dashboard"`` (see :mod:`~lightning_nanguard_tensorboard.incidents`), sorted by
  ``(global_step, rank)``; ``offset``/``limit`` return a page; the total is in ``X-Total-Count``;
- ``incident?run=RUN&index=I``: one event with its context (source lines, stack, thumbnails) and
  its repro bundle's status (``present``, ``pruned``, ``none``) and replay command;
- ``thumbnail?run=RUN&index=I&position=P``: the PNG of an offending sample;
- ``timeline?run=RUN[&loss_tag=TAG]``: incident markers, the gradient norm, the training loss and
  the counters' increments;
- ``summary?run=RUN``: counts by kind, cause and action, dataset indices and origins ranked;
- ``static/<file>``: the ES module and the stylesheet (no build step, nothing from the network).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from lightning_nanguard_tensorboard import PLUGIN_NAME
from lightning_nanguard_tensorboard.incident_files import bundle_info, find_context, thumbnail_path
from lightning_nanguard_tensorboard.incidents import IncidentStore
from lightning_nanguard_tensorboard.runs import RunIndex, RunLocation, logdir_roots
from lightning_nanguard_tensorboard.summary import run_summary
from lightning_nanguard_tensorboard.timeline import (
    COUNTER_TAGS,
    GRAD_NORM_TAG,
    MAX_POINTS,
    increments,
    loss_tags,
    markers,
    pick_loss_tag,
    points,
)

__all__ = ["NanGuardPlugin"]

logger = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css"}
SCALARS_PLUGIN = "scalars"
MAX_PAGE = 1000

Handler = Callable[[Any, Any], Any]  # a WSGI app: (environ, start_response) -> body


class BadRequest(ValueError):
    """A malformed query parameter (answered with 400)."""


def _int_arg(request: Any, name: str, default: int | None = None, low: int = 0) -> int:
    raw = request.args.get(name)
    if raw is None:
        if default is None:
            raise BadRequest(f"missing query parameter {name!r}")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name!r} must be an integer, got {raw!r}") from None
    if value < low:
        raise BadRequest(f"query parameter {name!r} must be >= {low}, got {value}")
    return value


def _json(request: Any, body: Any, code: int = 200, headers: list[tuple[str, str]] | None = None) -> Any:
    """A JSON response.

    Events are JSON-safe already (``to_dict()`` spells NaN/Inf as strings), so they are serialised
    directly; only a body that is not (a NaN float) goes through TensorBoard's slower cleansing,
    which spells such values ``"NaN"``.
    """
    try:
        content: Any = json.dumps(body, allow_nan=False, separators=(",", ":"))
    except ValueError:
        content = body
    return http_util.Respond(request, content, "application/json", code=code, headers=headers)


def _route(handler: Callable[[NanGuardPlugin, Any], Any]) -> Callable[[NanGuardPlugin, Any, Any], Any]:
    """A WSGI route answering 400 for bad parameters and 500 (logged) for anything else, never crashing."""

    @functools.wraps(handler)
    def route(self: NanGuardPlugin, environ: Any, start_response: Any) -> Any:
        request = wrappers.Request(environ)
        try:
            response = handler(self, request)
        except BadRequest as error:
            response = _json(request, {"error": str(error)}, code=400)
        except Exception as error:
            logger.exception("NanGuard plugin: %s failed", request.path)
            response = _json(request, {"error": f"{type(error).__name__}: {error}"}, code=500)
        return response(environ, start_response)

    return route


class NanGuardPlugin(base_plugin.TBPlugin):
    """The NanGuard tab: incidents, their context, and a summary per run."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        flags = context.flags
        logdir = context.logdir or getattr(flags, "logdir", None)
        self._runs = RunIndex(logdir_roots(logdir, getattr(flags, "logdir_spec", None)))
        self._store = IncidentStore()
        self._data_provider = context.data_provider
        self._static = {name for name in os.listdir(STATIC_DIR) if os.path.splitext(name)[1] in STATIC_TYPES}

    def get_plugin_apps(self) -> dict[str, Handler]:
        apps: dict[str, Handler] = {
            "/runs": self._serve_runs,
            "/incidents": self._serve_incidents,
            "/incident": self._serve_incident,
            "/thumbnail": self._serve_thumbnail,
            "/timeline": self._serve_timeline,
            "/summary": self._serve_summary,
            "/static/*": self._serve_static,
        }
        return apps

    def is_active(self) -> bool:
        return bool(self._runs.runs())

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/static/index.js", tab_name="NanGuard")

    # ------------------------------------------------------------------ helpers

    def _run(self, request: Any) -> RunLocation | None:
        return self._runs.get(request.args.get("run"))

    def _scalars(self, request: Any, run: str, tags: list[str] | None) -> dict[str, Any]:
        """``{tag: [ScalarDatum]}`` of ``run`` through the data provider (``tags=None``: list the tags)."""
        if self._data_provider is None:
            return {}
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        try:
            if tags is None:
                listing = self._data_provider.list_scalars(
                    ctx,
                    experiment_id=experiment,
                    plugin_name=SCALARS_PLUGIN,
                    run_tag_filter=provider.RunTagFilter(runs=[run]),
                )
                return dict(listing.get(run, {}))
            data = self._data_provider.read_scalars(
                ctx,
                experiment_id=experiment,
                plugin_name=SCALARS_PLUGIN,
                downsample=MAX_POINTS,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags),
            )
            return dict(data.get(run, {}))
        except Exception:  # a run without TensorBoard event files, or a provider error: no curves
            logger.debug("NanGuard plugin: no scalars for run %r", run, exc_info=True)
            return {}

    # ------------------------------------------------------------------ routes

    @_route
    def _serve_runs(self, request: Any) -> Any:
        body = []
        for name, run in sorted(self._runs.runs().items()):
            events = self._store.events(run)
            steps = [e["global_step"] for e in events]
            body.append(
                {
                    "run": name,
                    "incidents": len(events),
                    "precursors": sum("precursor" in (e.get("kinds") or ()) for e in events),
                    "first_step": min(steps) if steps else None,
                    "last_step": max(steps) if steps else None,
                }
            )
        return _json(request, body)

    @_route
    def _serve_incidents(self, request: Any) -> Any:
        run = self._run(request)
        events = self._store.events(run) if run is not None else []
        total = len(events)
        if "offset" in request.args or "limit" in request.args:
            offset = _int_arg(request, "offset", 0)
            limit = min(_int_arg(request, "limit", MAX_PAGE, low=1), MAX_PAGE)
            events = events[offset : offset + limit]
        return _json(request, list(events), headers=[("X-Total-Count", str(total))])

    @_route
    def _serve_incident(self, request: Any) -> Any:
        run = self._run(request)
        index = _int_arg(request, "index")
        events = self._store.events(run) if run is not None else []
        if run is None or index >= len(events):
            return _json(request, {"error": "no such incident"}, code=404)
        found = find_context(run, events, index)
        context = found[1] if found is not None else None
        return _json(request, {"event": events[index], "context": context, "bundle": bundle_info(run, events[index])})

    @_route
    def _serve_thumbnail(self, request: Any) -> Any:
        run = self._run(request)
        index = _int_arg(request, "index")
        position = _int_arg(request, "position")
        events = self._store.events(run) if run is not None else []
        found = find_context(run, events, index) if run is not None and index < len(events) else None
        path = thumbnail_path(run, found[0], position) if run is not None and found is not None else None
        if path is None:
            return http_util.Respond(request, "no such thumbnail", "text/plain", code=404)
        with open(path, "rb") as handle:
            return http_util.Respond(request, handle.read(), "image/png", expires=3600)

    @_route
    def _serve_timeline(self, request: Any) -> Any:
        run = self._run(request)
        if run is None:
            return _json(request, {"markers": [], "grad_norm": [], "loss": None, "loss_tags": [], "counters": {}})
        events = self._store.events(run)
        available = self._scalars(request, run.name, None)
        candidates = loss_tags(available)
        requested = request.args.get("loss_tag")
        loss_tag = requested if requested in candidates else pick_loss_tag(candidates)
        wanted = [t for t in (GRAD_NORM_TAG, loss_tag, *COUNTER_TAGS.values()) if t is not None and t in available]
        data = self._scalars(request, run.name, wanted) if wanted else {}
        counters = {
            name: increments([(d.step, d.value) for d in data[tag]])
            for name, tag in COUNTER_TAGS.items()
            if tag in data
        }
        steps = [e["global_step"] for e in events] + [int(d.step) for series in data.values() for d in series]
        body = {
            "run": run.name,
            "markers": markers(events),
            "grad_norm": points(data.get(GRAD_NORM_TAG, [])),
            "loss": {"tag": loss_tag, "points": points(data[loss_tag])} if loss_tag in data else None,
            "loss_tags": candidates,
            "counters": counters,
            "step_range": [min(steps), max(steps)] if steps else None,
        }
        return _json(request, body)

    @_route
    def _serve_summary(self, request: Any) -> Any:
        run = self._run(request)
        if run is None:
            return _json(request, run_summary([]))
        skipped = self._scalars(request, run.name, [COUNTER_TAGS["skipped"]]).get(COUNTER_TAGS["skipped"], [])
        skipped_total = float(skipped[-1].value) if skipped else None
        body = run_summary(self._store.events(run), skipped_total=skipped_total)
        body["run"] = run.name
        body["last_logged_step"] = self._last_logged_step(request, run.name)
        return _json(request, body)

    def _last_logged_step(self, request: Any, run: str) -> int | None:
        listing = self._scalars(request, run, None)
        steps = [int(series.max_step) for series in listing.values() if getattr(series, "max_step", None) is not None]
        return max(steps) if steps else None

    @_route
    def _serve_static(self, request: Any) -> Any:
        name = request.path.rsplit("/", 1)[-1]
        if name not in self._static:
            return http_util.Respond(request, "not found", "text/plain", code=404)
        with open(os.path.join(STATIC_DIR, name), "rb") as handle:
            content = handle.read()
        return http_util.Respond(request, content, STATIC_TYPES[os.path.splitext(name)[1]])
