"""The precursor watch as a part of the engine: configured, attached, armed before a forward, judged at the check.

:class:`~lightning_nanguard.engine.step.precursors.PrecursorWatch` measures the attention logits on
sampled steps; :class:`PrecursorPart` is what the step controller holds of it: it arms the watch
before a sampled step's forward, writes the measured values as ``nanguard/attention_*`` scalars
and the early warnings as ``precursor`` events at the step's check, and applies QK-clip after the
update (with a max over ranks under DDP, which every rank must join at the same steps). A failure
turns the part off alone (:class:`~lightning_nanguard.engine.parts.GuardParts`): the hooks come off
the model and QK-clip goes with it.

Example:
    >>> from lightning_nanguard.engine.parts import GuardParts
    >>> from lightning_nanguard.engine.recording import IncidentRecorder
    >>> part = PrecursorPart(GuardParts(), IncidentRecorder(verbose=False))
    >>> part.configure(None, refused=None)
    >>> part.watch is None
    True
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor, nn

from lightning_nanguard.detect.precursors import PrecursorSettings
from lightning_nanguard.engine.parts import GuardParts
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.step.precursors import PrecursorWatch, precursor_event
from lightning_nanguard.reporting.notice_texts import NO_QK_PROJECTIONS, QK_CLIP_MANUAL_DDP

if TYPE_CHECKING:
    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["PrecursorPart"]

log = logging.getLogger("lightning_nanguard")


class PrecursorPart:
    """The precursor watch and QK-clip, as the controller drives them (see module docs)."""

    def __init__(self, parts: GuardParts, recorder: IncidentRecorder) -> None:
        self.parts = parts
        self.recorder = recorder
        self.watch: PrecursorWatch | None = None
        self.collective = False  # QK-clip takes a max over ranks after each sampled step (DDP)

    def configure(self, settings: PrecursorSettings | None, refused: str | None) -> None:
        """New settings: a new watch when they changed, none when the watch is off (or ``refused``, with why)."""
        if refused is not None:
            self.recorder.notices.warn("precursors-refused", refused)
        if settings is None:
            self.drop()
        elif self.watch is None or self.watch.settings != settings:
            self.watch = PrecursorWatch(settings)
        if self.watch is not None:
            self.parts.when_off("precursors", self.drop)

    def attach(self, module: nn.Module, distributed: bool) -> None:
        """Hook the attention modules of ``module``; QK-clip under DDP samples the same steps on every rank."""
        watch = self.watch
        if watch is None:
            return
        watch.attach(module)
        if watch.settings.qk_clip is not None and not watch.projections:
            self.recorder.notices.warn("qk_clip", NO_QK_PROJECTIONS)
        if watch.projections and distributed:
            watch.governed = False  # QK-clip's collective needs the same sampled steps on every rank
            self.collective = True

    def disarm(self) -> None:
        """Stop measuring a sampled step in progress (its hooks off the model); the watch stays on. Never raises."""
        if self.watch is not None:
            try:
                self.watch.disarm()
            except Exception as error:  # removing hooks is best effort: the fit is ending
                log.debug("NanGuard: disarming the precursor watch failed: %r", error)

    def drop(self) -> None:
        """The watch failed or was turned off: remove its hooks from the model (QK-clip goes with it)."""
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.disarm()

    def clip_failed_here(self) -> bool:
        """QK-clip joins a collective on every rank and is off here: the step's reduce must say so."""
        return self.collective and (self.watch is None or not self.parts.on("qk_clip"))

    def clip_failed_elsewhere(self) -> None:
        """Another rank's QK-clip is off: no rank joins its collective from now on."""
        if self.watch is not None and self.parts.on("qk_clip"):
            self.parts.off_elsewhere("qk_clip")

    def arm(self, step: int) -> None:
        """The step about to run: measure its attention when it is a sampled step (before its forward)."""
        watch = self.watch
        if watch is not None and watch.near_sample(step):  # most steps: nothing to arm, no call through the part
            self.parts.run("precursors", watch.arm, step)

    def check(self, front: FrontEnd) -> None:
        """The step is checked: stop measuring; write and judge the samples already on the host (no wait)."""
        if self.watch is not None and not self.watch.idle:
            self.parts.run("precursors", self._check, front)

    def _check(self, front: FrontEnd) -> None:
        watch = self.watch
        assert watch is not None
        watch.finish(front.global_step)
        if watch.notice is not None:
            self.recorder.notices.warn(f"precursor-cost-{watch.every}", watch.notice)
            watch.notice = None
        samples = watch.ready()
        if not samples or not front.is_global_zero:  # one rank warns (each rank measures its own rows)
            return
        cap = watch.settings.qk_clip
        for step in sorted({sample.step for sample in samples}):
            values = {}
            for sample in (s for s in samples if s.step == step):
                values[f"nanguard/attention_max_logit/{sample.module}"] = sample.max_logit
                values[f"nanguard/attention_entropy/{sample.module}"] = sample.entropy
                if cap is not None and sample.module in watch.projections:  # the factor QK-clip applied (this rank's)
                    factor = cap / sample.max_logit if sample.max_logit > cap else 1.0
                    values[f"nanguard/qk_clip/{sample.module}"] = factor
            self.recorder.sinks.write_scalars(front, values, step)
        for warning, sample in watch.judge(samples):
            event = precursor_event(warning, sample, watch.settings, front.current_epoch, front.global_rank)
            self.recorder.record(front, event)

    def clip(self, collective: bool, distributed: bool, reduce_max: Callable[[Tensor], Tensor] | None) -> None:
        """After the update: rescale what QK-clip caps (``collective``: every rank takes part in a max)."""
        watch = self.watch
        if watch is None or not watch.projections:
            return
        if not self.parts.on("qk_clip"):
            watch.forget_clip()
        elif collective or not distributed:
            self.parts.run("qk_clip", watch.clip, reduce_max if distributed else None)
        else:  # manual optimisation on several ranks: no collectives, so no rank may rescale alone
            watch.forget_clip()
            self.recorder.notices.warn("qk_clip", QK_CLIP_MANUAL_DDP)
