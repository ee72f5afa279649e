"""The attention precursor watch of a run: sample the attention logits, warn of a collapse ahead.

Every ``every_n_steps`` optimizer steps the :class:`~lightning_nanguard.detect.attention.AttentionProbe`
watches the step's forward passes (armed when the step begins, taken when it is checked). The values
stay on the device and are copied to the host without waiting; they are read at a later check once
the copy has landed (no host synchronisation, also under ``sync_free``). Each sampled value goes to
the :class:`~lightning_nanguard.detect.precursors.LogitGrowthRule`; an early warning becomes a ``precursor``
event (the step is applied) and the per-module values ``nanguard/`` scalars.

With ``qk_clip`` (a cap, opt-in) the sampled step's per-head max logits also stay on the device
until the optimizer has stepped; then :meth:`PrecursorWatch.clip` rescales the query and key
projections of each module above the cap (:mod:`~lightning_nanguard.recover.qk_clip`), on the
device, after one max-reduce over the ranks under DDP.

Example:
    >>> import torch
    >>> from torch import nn
    >>> watch = PrecursorWatch(PrecursorSettings(every_n_steps=1))
    >>> class Attention(nn.Module):
    ...     def forward(self, q):
    ...         return torch.softmax(q @ q.transpose(-2, -1), dim=-1)
    >>> model = nn.Sequential(Attention())
    >>> watch.attach(model)
    >>> watch.arm(0)
    >>> _ = model(torch.ones(1, 2, 2, requires_grad=True))
    >>> watch.finish(0)
    >>> [(s.module, round(s.max_logit, 1)) for s in watch.ready()]
    [('0', 2.0)]
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from time import perf_counter  # bound at import: a test that replaces time.perf_counter leaves the guard's own clock
from typing import Any

import torch
from torch import Tensor, nn

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.detect.attention import AttentionProbe, AttentionStats, merged_stats, summarise
from lightning_nanguard.detect.precursors import EarlyWarning, PrecursorSettings
from lightning_nanguard.recover.qk_clip import QKProjection, find_qk_projections, qk_clip_

__all__ = ["PrecursorWatch", "Sample", "precursor_event"]

MAX_EVERY = 10_000  # the widest sampling interval the cost limit may set

FIXES = (
    "QK-layernorm (normalise queries and keys per head)",
    "a lower learning rate or a longer warm-up",
    "QK-clip (rescale the query and key projections when the max logit passes a cap)",
    "logit soft-capping (cap * tanh(logits / cap))",
)


@dataclass(frozen=True)
class Sample:
    """One module's values at one sampled step, read to the host."""

    step: int
    module: str
    max_logit: float
    entropy: float
    min_entropy: float


class PrecursorWatch:
    """Arm, take, read and judge the attention samples of a run (see module docs)."""

    def __init__(self, settings: PrecursorSettings) -> None:
        self.settings = settings
        self.every = settings.every_n_steps  # the sampling interval in use (widened to keep within ``max_cost``)
        self.governed = settings.max_cost is not None  # off where the ranks must sample the same steps
        self.notice: str | None = None  # for the guard to log once: the interval was widened
        self._last_begin: tuple[int, float] | None = None  # (step, host clock) of the last step begun
        self._step_seconds: deque[float] = deque(maxlen=50)
        self._measure_seconds: deque[float] = deque(maxlen=5)
        self.rule = settings.rule()
        self.probe: AttentionProbe | None = None
        self._armed: ExitStack | None = None
        self._armed_step = -1
        self._pending: list[tuple[int, list[tuple[list[str], Tensor, Any]]]] = []  # (step, [(calls, host copy, event)])
        self.projections: dict[str, QKProjection] = {}  # QK-clip's modules (``qk_clip`` set)
        self._to_clip: dict[str, AttentionStats] | None = None  # a sampled step's values, until its update

    def attach(self, module: nn.Module) -> None:
        """Watch ``module``'s attention (its module names are the ones reported)."""
        self.disarm()
        clipping = self.settings.qk_clip is not None
        self.probe = AttentionProbe(module, rows=self.settings.rows, per_head=clipping)
        self.projections = find_qk_projections(module) if clipping else {}
        self._to_clip = None

    def near_sample(self, step: int) -> bool:
        """Whether :meth:`arm` does anything at ``step``: a sampled step, or the one before (timed for the limit)."""
        every = self.every
        return not (step % every and (step + 1) % every)

    def arm(self, step: int) -> None:
        """Step ``step`` begins: measure its forward passes when it is a sampled step (idempotent).

        The step time the cost limit compares with is the one of the step before each sampled step
        (timed from its beginning to the sampled step's): the other steps do nothing here.
        """
        if not self.near_sample(step):
            return
        now = perf_counter()
        if self._last_begin is None or self._last_begin[0] != step:
            if self._last_begin is not None and step == self._last_begin[0] + 1:
                self._step_seconds.append(now - self._last_begin[1])
            self._last_begin = (step, now)
        if self.probe is None or step % self.every or self._armed is not None:
            return
        if not self.projections and self.probe.skip_idle_pass():  # QK-clip joins its collective on every sampled step
            return
        stack = ExitStack()
        stack.enter_context(self.probe.measuring())
        self._armed, self._armed_step = stack, step

    def disarm(self) -> None:
        if self._armed is not None:
            self._armed.close()
            self._armed = None

    def finish(self, step: int) -> None:
        """Step ``step`` is checked: stop measuring; start the values' copy to the host (no wait)."""
        if self._armed is None:
            return
        self.disarm()
        assert self.probe is not None
        parts = self.probe.take_calls()
        self._govern(self.probe.host_seconds)
        if self._armed_step != step:
            return
        if self.projections:  # every rank clips on every sampled step, measured or not (one collective each)
            self._to_clip = merged_stats(parts)
        if not parts:
            return
        copies = []
        for part in parts:  # one device in the usual case: one copy of the step's (calls, 4) values
            values, event = part.values, None
            if values.is_cuda:
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                host = values
            copies.append((part.names, host, event))
        self._pending.append((step, copies))

    @property
    def idle(self) -> bool:
        """Nothing to finish, write or say at a check: no step measured, no copy pending, no notice."""
        return self._armed is None and not self._pending and self.notice is None

    def ready(self) -> list[Sample]:
        """The samples whose copy has landed (earlier steps first); nothing waits for the device."""
        out: list[Sample] = []
        while self._pending:
            step, copies = self._pending[0]
            if any(event is not None and not event.query() for _, _, event in copies):
                break
            self._pending.pop(0)
            names: list[str] = []
            rows: list[list[float]] = []
            for calls, host, _ in copies:
                names += calls
                rows += host.tolist()
            for module, values in sorted(summarise(names, rows).items()):
                out.append(Sample(step, module, *values))
        return out

    def judge(self, samples: list[Sample]) -> list[tuple[EarlyWarning, Sample]]:
        """The early warnings among ``samples`` (at most one per module per ``cooldown`` steps)."""
        found = []
        for sample in samples:
            warning = self.rule.observe(sample.module, sample.step, sample.max_logit)
            if warning is not None:
                found.append((warning, sample))
        return found

    def clip(self, reduce_max: Callable[[Tensor], Tensor] | None = None) -> None:
        """After the sampled step's optimizer step: QK-clip the modules measured above the cap (no host read).

        ``reduce_max`` takes the max over ranks (every rank calls it on a sampled step, with one
        value per head of every module QK-clip knows, in name order; a module not measured on a
        rank takes part with ``-inf``). A rank whose values cannot be made still joins that reduce,
        with a failure flag that makes no rank rescale (the weights stay identical on every rank),
        and raises afterwards (the guard then switches QK-clip off on every rank at the next check).
        """
        stats, self._to_clip = self._to_clip, None
        cap = self.settings.qk_clip
        if stats is None or cap is None or not self.projections:
            return
        modules = sorted(self.projections.items())
        device = modules[0][1].queries[0][0].device
        sizes = [projection.heads or 1 for _, projection in modules]
        error: Exception | None = None
        try:
            values = torch.cat([_per_head(stats.get(name), projection, device) for name, projection in modules])
        except Exception as failure:
            error, values = failure, torch.full((sum(sizes),), -math.inf, device=device)
        if reduce_max is not None:
            failed = torch.full((1,), 1.0 if error is not None else 0.0, device=device)
            reduced = reduce_max(torch.cat((values.float(), failed)))
            values = torch.where(reduced[-1:] > 0, -math.inf, reduced[:-1])  # a failure anywhere: no rank rescales
        if error is not None:
            raise error
        for (_, projection), logit in zip(modules, values.split(sizes), strict=True):
            qk_clip_(projection, logit if projection.heads is not None else logit[0], cap)

    def _govern(self, seconds: float) -> None:
        """Widen the sampling interval when the measurement costs more than ``max_cost`` of the training time.

        The share is the median host time of the last sampled steps' measurements over the median
        step time times the interval. Host time is what the measurement costs on a GPU too (its
        kernels are small), read from the host clock: no synchronisation. The interval only grows.
        """
        self._measure_seconds.append(seconds)
        limit = self.settings.max_cost
        if not self.governed or limit is None or len(self._measure_seconds) < 3 or len(self._step_seconds) < 3:
            return
        step, cost = statistics.median(self._step_seconds), statistics.median(self._measure_seconds)
        share = cost / max(step * self.every, 1e-9)
        if share <= limit:
            return
        before, self.every = self.every, min(MAX_EVERY, math.ceil(self.every * share / limit))
        self._measure_seconds.clear()
        self.notice = (
            f"NanGuard: the attention precursor watch costs {1e3 * cost:.1f} ms "
            f"per measured step against {1e3 * step:.1f} ms per training step ({100 * share:.1f}% of the training "
            f"time when measuring every {before} steps): measuring every {self.every} steps from now on to stay "
            f"within precursor_max_cost={limit:g}. Set precursor_max_cost=None to keep every {before} whatever "
            "it costs."
        )

    def forget_clip(self) -> None:
        """Drop the sampled step's values without clipping."""
        self._to_clip = None

    def state_dict(self) -> dict[str, Any]:
        return self.rule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rule.load_state_dict(state)


def precursor_event(
    warning: EarlyWarning, sample: Sample, settings: PrecursorSettings, epoch: int, rank: int
) -> NanEvent:
    """The ``precursor`` event of one early warning: the step was applied; module, signal, value, trend, fixes."""
    return NanEvent(
        global_step=warning.step,
        epoch=epoch,
        batch_idx=warning.step,
        rank=rank,
        kinds=("precursor",),
        action="warned",
        culprit_module=warning.module,
        details={
            "signal": "attention_max_logit",
            "value": warning.value,
            "threshold": settings.min_logit,
            "growth": warning.ratio,
            "growth_threshold": settings.growth,
            "earlier_value": warning.earlier,
            "earlier_step": warning.earlier_step,
            "entropy": sample.entropy,
            "min_entropy": sample.min_entropy,
            "fixes": list(FIXES),
        },
    )


def _per_head(stats: AttentionStats | None, projection: QKProjection, device: torch.device) -> Tensor:
    """One module's max logits for QK-clip: one per head (heads unknown: one); ``-inf`` where not measured."""
    heads = projection.heads or 1
    if stats is None:
        return torch.full((heads,), -math.inf, device=device)
    if stats.head_max is not None and stats.head_max.numel() == heads:
        return stats.head_max.float()
    return stats.max_logit.float().reshape(1).expand(heads)  # no head dimension seen: the module's max for each
