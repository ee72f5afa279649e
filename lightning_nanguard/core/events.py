"""The record of one bad training step (:class:`NanEvent`) and the error that carries it.

``NanEvent`` and its ``to_dict()`` keys are a public contract: ``events.jsonl`` holds one
``to_dict()`` object per line, and dashboards and scripts read those keys. Fields may be added,
never renamed or removed. ``sample_loaders`` (several training loaders) is written only when set,
so the events of a run with one training loader are the same as before it existed; so are
``indices_verified``, ``blame_verified``, ``sample_records`` and ``optimizer``, written only when set.
The guard builds an event in one place, from the sections its stages return
(:mod:`lightning_nanguard.core.event_builder`); every ``details`` key it writes is registered, with
its meaning, in :mod:`lightning_nanguard.core.detail_keys`.

Glossary (each word has one meaning throughout the package; fuller in ``docs/glossary.md``):

- **event**: the record of one bad step on one rank, a :class:`NanEvent` (one line of ``events.jsonl``).
- **incident**: a bad step the guard investigates: NaN/Inf confirmed element-wise (not an AMP overflow).
- **cause**: what the diagnosis concludes about an incident or spike (:data:`EventCause`, ``NanEvent.cause``).
- **finding**: what one rank found on a bad step before the search, shared to plan it (``decide.search_plan.Finding``).
- **vote**: what one rank puts into the shared step decision (``decide.policy.RankVote``).
- **search result**: what one rank's search gave, shared to choose who records (``decide.search_plan.SearchResult``).
- **flags**: the device-side 0/1 values of a step's check, read by the host once (or one step late, sync-free).
- **origin**: where the first NaN/Inf was born: phase, op, module, source line (``diagnose.localization.Localization``).
- **pass result**: what one pass of a sub-batch gave, ``(bad, non-finite)`` (``diagnose.lockstep.PassResult``).
- **core**: what keeps NaN/Inf out of the weights; only its error turns the guard off (``engine.parts.CORE``).
- **part**: an optional part of the guard, switched off alone at its first error (``engine.parts.OPTIONAL_PARTS``).
- **guard error**: an error of the guard itself, an event of kind ``guard_error`` (``engine.parts.PartFailure``).
- **bundle**: the directory that lets ``replay`` re-run a bad step in a fresh process (``reporting.repro``).
- **section**: one stage's share of an event (where, found, forensics, rows, decided, files) (``core.event_builder``).
- **front-end**: what connects the engine to a loop: ``FabricGuard``, ``NanGuard`` (``engine.frontend.FrontEnd``).
- **moment**: a point of a loop the engine acts at: batch, loss, step, after step... (``engine.moments.GuardEngine``).
- **optimizer step**: one ``optimizer.step()``, the unit the guard checks, drops and counts (per optimizer).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = [
    "EVENT_CAUSES",
    "EVENT_KINDS",
    "EventAction",
    "EventCause",
    "EventKind",
    "GuardInternalError",
    "NanEvent",
    "NonFiniteTrainingError",
]

EventKind = Literal[
    "loss", "grad", "bn_stats", "param", "loss_scale", "loss_spike", "grad_spike", "precursor", "guard_error"
]
EventAction = Literal["skipped", "raised", "warned", "rolled_back"]
EventCause = Literal["data", "input", "state", "interaction", "batch"]
EVENT_KINDS: tuple[EventKind, ...] = get_args(EventKind)
EVENT_CAUSES: tuple[EventCause, ...] = get_args(EventCause)
SPIKE_KINDS: tuple[EventKind, ...] = ("loss_spike", "grad_spike")


_OMITTED_WHEN_NONE = frozenset({"sample_loaders", "indices_verified", "blame_verified", "sample_records", "optimizer"})


def _json_float(value: float | None) -> float | str | None:
    """JSON has no NaN/Inf literals: spell them as strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float spelled as :func:`_json_float` does, in nested dicts and lists too.

    Examples:
        >>> _json_safe({"ratio": float("inf"), "rows": [1.0, float("nan")], "ok": (2,)})
        {'ratio': 'inf', 'rows': [1.0, 'nan'], 'ok': [2]}
    """
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, Mapping):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def _from_json_float(value: float | str | None) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class NanEvent:
    """What went non-finite in one training step, and what the guard did about it.

    Args:
        global_step: ``trainer.global_step`` when the step was checked (the step that was bad).
        epoch: ``trainer.current_epoch``.
        batch_idx: index of the batch within the epoch (the last micro-batch under accumulation).
        rank: global rank of the process that saw the non-finite value.
        kinds: what was wrong, a subset of ``("loss", "grad", "bn_stats", "param", "loss_scale",
            "loss_spike", "grad_spike", "precursor", "guard_error")`` (``"loss_scale"``: a GradScaler's
            scale collapsed under repeated overflow; ``"loss_spike"``/``"grad_spike"``: a finite loss or gradient norm
            far above its recent healthy values; ``"precursor"``: an early warning, e.g. an attention
            module's max logit growing towards collapse, with ``action="warned"``: the step was applied;
            ``"guard_error"``: a part of the guard itself failed, ``details["part"]`` says which and what
            stops, see :class:`GuardInternalError`).
        nonfinite_grads: qualified names of parameters whose gradient holds NaN/Inf.
        nonfinite_buffers: qualified names of BatchNorm buffers holding NaN/Inf (or a negative
            ``running_var``), e.g. ``"net.1.running_var"``.
        loss: the loss of the step (``nan``/``inf`` allowed), ``None`` when unknown.
        action: ``"skipped"``, ``"raised"``, ``"warned"`` or ``"rolled_back"``.
        offending_samples: positions in the batch that make the step non-finite, ``None`` when
            not searched or not attributable to individual samples.
        dataset_indices: dataset indices of ``offending_samples`` when recoverable.
        culprit_module: qualified module name where the first non-finite value was produced
            (``""`` for code in the LightningModule itself).
        culprit_op: autograd op name, e.g. ``"SqrtBackward0"``.
        source_line: ``"path/to/file.py:LINE"`` of the op in the user's code.
        phase: ``"forward"`` or ``"backward"``: where the first non-finite value appeared.
        remedies: remedies applied in response, as readable strings.
        repro_path: directory of the saved repro bundle.
        grad_norm: global L2 norm of all gradients of the step (``inf``/``nan`` allowed).
        nonfinite_params: qualified names of parameters whose values hold NaN/Inf.
        details: free-form notes (why samples were not attributable, source text, hints).
        cause: what the diagnosis concluded: ``"data"`` (a proper subset of the samples reproduces
            it), ``"input"`` (the batch itself holds NaN/Inf), ``"state"`` (the weights or optimizer
            state are at fault: no sample is to blame), ``"interaction"`` (samples that fail only
            together), ``"batch"`` (the batch as a whole: samples fail on their own or together, but
            none fails beside known-healthy samples, e.g. a loss averaged over zero targets or a
            statistic of a degenerate batch; no sample is named), or ``None`` (not investigated).
        sample_loaders: with several training loaders (a dict or list of loaders, a
            ``CombinedLoader``), the loader of each offending sample, aligned with
            ``offending_samples``: its dict key or list position (a dotted path when nested, e.g.
            ``"tasks.0"``). ``offending_samples`` are then positions in that loader's part of the
            batch, and ``dataset_indices`` indices in that loader's dataset. ``None`` with one
            loader (and then absent from :meth:`to_dict`).
        indices_verified: whether ``dataset_indices`` (or ``sample_records``) name the records really
            in the offending rows: ``True`` when each named record was re-read and matches its row
            (corrected when the collate reorders rows) or was read from the batch's own index field
            (``index_key``), or mapped by the user's ``row_records`` hook; ``False`` when not verified,
            or when no index could be named for a row (``details["indices_unverified"]`` says why);
            ``None`` when there was nothing to check (absent from :meth:`to_dict`).
        blame_verified: whether each named sample is really at fault: ``True`` when it re-ran bad
            beside known-healthy samples (cause ``"data"``) or holds NaN/Inf itself (cause
            ``"input"``); ``False`` when that could not be checked (``details["blame_unverified"]``
            says why); ``None`` when no sample is named (absent from :meth:`to_dict`).
        sample_records: for rows that hold several records (packed sequences, mixup), the dataset
            indices each offending row holds, aligned with ``offending_samples``; ``dataset_indices``
            is then ``None``. ``None`` when every row is one record (absent from :meth:`to_dict`).
        optimizer: the index of the optimizer whose step it was: its position in ``trainer.optimizers``,
            or in a Fabric loop the order in which the optimizers first stepped; ``None`` when unknown
            (absent from :meth:`to_dict`; events written before it existed read as ``None``).

    Quarantine acts only on records whose index and blame are both verified.

    Examples:
        >>> event = NanEvent(global_step=3, epoch=0, batch_idx=3, rank=0, kinds=("loss",),
        ...                  loss=float("nan"), action="skipped")
        >>> event.to_dict()["loss"]
        'nan'
        >>> NanEvent.from_dict(event.to_dict()).kinds
        ('loss',)
    """

    global_step: int
    epoch: int
    batch_idx: int
    rank: int
    kinds: tuple[EventKind, ...]
    action: EventAction
    nonfinite_grads: tuple[str, ...] = ()
    nonfinite_buffers: tuple[str, ...] = ()
    loss: float | None = None
    offending_samples: tuple[int, ...] | None = None
    dataset_indices: tuple[int, ...] | None = None
    culprit_module: str | None = None
    culprit_op: str | None = None
    source_line: str | None = None
    phase: Literal["forward", "backward"] | None = None
    remedies: tuple[str, ...] = ()
    repro_path: str | None = None
    grad_norm: float | None = None
    nonfinite_params: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)
    cause: EventCause | None = None
    sample_loaders: tuple[str | int, ...] | None = None
    indices_verified: bool | None = None
    blame_verified: bool | None = None
    sample_records: tuple[tuple[int, ...], ...] | None = None
    optimizer: int | None = None

    @classmethod
    def at_step(cls, trainer: Any, batch_idx: int, kinds: Sequence[EventKind], **fields: Any) -> NanEvent:
        """An event of the step ``trainer`` is at (its global step, epoch and rank; 0 without a Trainer).

        Examples:
            >>> from types import SimpleNamespace
            >>> trainer = SimpleNamespace(global_step=7, current_epoch=1, global_rank=0)
            >>> NanEvent.at_step(trainer, 3, ("loss",), loss=float("nan")).headline()[:40]
            'step 7 (epoch 1, batch 3): non-finite lo'
        """
        return cls(
            global_step=getattr(trainer, "global_step", 0),
            epoch=getattr(trainer, "current_epoch", 0),
            batch_idx=batch_idx,
            rank=getattr(trainer, "global_rank", 0),
            kinds=tuple(kinds),
            action=fields.pop("action", "warned"),
            **fields,
        )

    def replace(self, **changes: Any) -> NanEvent:
        """A copy with some fields changed (events are immutable).

        Examples:
            >>> NanEvent(1, 0, 1, 0, ("grad",), "warned").replace(action="raised").action
            'raised'
        """
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict: tuples become lists, non-finite floats become ``"nan"``/``"inf"`` (in ``details`` too).

        ``sample_loaders`` is left out when ``None`` (one training loader).

        Examples:
            >>> two = NanEvent(3, 0, 3, 0, ("loss",), "skipped", offending_samples=(1,), sample_loaders=("b",))
            >>> two.to_dict()["sample_loaders"]
            ['b']
            >>> "sample_loaders" in NanEvent(3, 0, 3, 0, ("loss",), "skipped").to_dict()
            False
        """
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _OMITTED_WHEN_NONE and value is None:
                continue
            if isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            elif isinstance(value, Mapping):
                value = _json_safe(value)  # details may hold NaN/Inf (a ratio, an entropy): JSON has no literal
            out[f.name] = value
        out["loss"] = _json_float(self.loss)
        out["grad_norm"] = _json_float(self.grad_norm)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NanEvent:
        """Rebuild an event from :meth:`to_dict` output; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        for key, value in kwargs.items():
            if isinstance(value, list):
                kwargs[key] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        kwargs["loss"] = _from_json_float(kwargs.get("loss"))
        kwargs["grad_norm"] = _from_json_float(kwargs.get("grad_norm"))
        return cls(**kwargs)

    def headline(self) -> str:
        """One line: when, what, and what was done.

        Examples:
            >>> NanEvent(12, 1, 4, 0, ("loss", "grad"), "skipped",
            ...          nonfinite_grads=("fc.weight",)).headline()
            'step 12 (epoch 1, batch 4): non-finite loss, grad (1 parameter grads) -> step skipped'
            >>> NanEvent(40, 0, 40, 0, ("loss_spike",), "skipped", loss=5e4,
            ...          details={"threshold": 3.1, "ratio": 49800.0}).headline()[29:]
            'loss spike (loss 5e+04, 4.98e+04x the recent level, threshold 3.1) -> step skipped'
        """
        when = f"step {self.global_step} (epoch {self.epoch}, batch {self.batch_idx})"
        if self.kinds == ("guard_error",):
            return f"{when}: {self._guard_error_words()}"
        if self.kinds == ("precursor",):
            return f"{when}: {self._precursor_words()} -> step applied"
        if all(kind in SPIKE_KINDS for kind in self.kinds):
            return f"{when}: {self._spike_words()} -> {self._done()}"
        what = ", ".join(self.kinds)
        counts = []
        if self.nonfinite_grads:
            counts.append(f"{len(self.nonfinite_grads)} parameter grads")
        if self.nonfinite_buffers:
            counts.append(f"{len(self.nonfinite_buffers)} BatchNorm buffers")
        if self.nonfinite_params:
            counts.append(f"{len(self.nonfinite_params)} parameters")
        if counts:
            what += f" ({', '.join(counts)})"
        return f"{when}: non-finite {what} -> {self._done()}"

    def _done(self) -> str:
        return {
            "skipped": "step skipped",
            "raised": "training stopped",
            "warned": "step applied (action='warn')" if self.kinds[0] not in SPIKE_KINDS else "step applied",
            "rolled_back": "rolled back to the last good state",
        }[self.action]

    def _guard_error_words(self) -> str:
        part, error = self.details.get("part", "?"), self.details.get("error", "?")
        if part == "core":
            done = {
                "skipped": "step skipped, the guard is off",
                "raised": "training stopped",
            }.get(self.action, "the step went ahead unchecked, the guard is off")
            return f"NanGuard's own check failed ({error}) -> {done}"
        return f"NanGuard's {part} part failed ({error}) -> that part is off; NaN/Inf steps are still skipped"

    def _precursor_words(self) -> str:
        d = self.details
        signal = str(d.get("signal", "precursor")).replace("_", " ")
        facts = []
        value, growth, threshold = d.get("value"), d.get("growth"), d.get("threshold")
        if isinstance(value, int | float):
            facts.append(f"{value:.3g}")
        if isinstance(growth, int | float) and isinstance(d.get("earlier_step"), int):
            facts.append(f"{growth:.3g}x since step {d['earlier_step']}")
        if isinstance(threshold, int | float):
            facts.append(f"threshold {threshold:.3g}")
        where = f" in {self.culprit_module}" if self.culprit_module else ""
        return (
            f"early warning{where}: {signal}"
            + (f" {facts[0]}" if facts else "")
            + (f" ({', '.join(facts[1:])})" if len(facts) > 1 else "")
        )

    def _spike_words(self) -> str:
        words = " and ".join("loss spike" if kind == "loss_spike" else "gradient-norm spike" for kind in self.kinds)
        facts = []
        if self.loss is not None and "loss_spike" in self.kinds:
            facts.append(f"loss {self.loss:.3g}")
        ratio, threshold = self.details.get("ratio"), self.details.get("threshold")
        if isinstance(ratio, int | float):
            facts.append(f"{ratio:.3g}x the recent level")
        if isinstance(threshold, int | float):
            facts.append(f"threshold {threshold:.3g}")
        return words + (f" ({', '.join(facts)})" if facts else "")


class NonFiniteTrainingError(RuntimeError):
    """Raised when training must stop because of non-finite values.

    Args:
        message: what happened and what to do next.
        events: the event(s) that led here, most recent last.

    Examples:
        >>> err = NonFiniteTrainingError("stop", [NanEvent(1, 0, 1, 0, ("loss",), "raised")])
        >>> err.event.global_step
        1
    """

    def __init__(self, message: str, events: Sequence[NanEvent]) -> None:
        super().__init__(message)
        self.events: list[NanEvent] = list(events)

    @property
    def event(self) -> NanEvent:
        """The most recent event."""
        return self.events[-1]


class GuardInternalError(RuntimeError):
    """The guard's own error, raised only with ``NanGuard(on_internal_error="raise")``.

    By default an internal error switches off the part it happened in (a ``guard_error`` event);
    users who prefer a crash (CI, a debugging session) get this instead.

    Args:
        part: the part that failed (``"core"`` or an optional part such as ``"spikes"``).
        error: ``repr`` of the original exception (also chained as ``__cause__``).
        where: the frame that raised.

    Examples:
        >>> str(GuardInternalError("spikes", "ValueError('x')", "spikes.py:3 in f"))
        "NanGuard's spikes part failed: ValueError('x') (at spikes.py:3 in f); on_internal_error='raise' stops \
training here."
    """

    def __init__(self, part: str, error: str, where: str) -> None:
        super().__init__(
            f"NanGuard's {part} part failed: {error} (at {where}); on_internal_error='raise' stops training here."
        )
        self.part, self.error, self.where = part, error, where

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes (ddp_spawn)
        return (type(self), (self.part, self.error, self.where))
