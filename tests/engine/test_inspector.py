"""The inspector's sections of an event: what it found, the optimizer's index, why no sample is named."""

from __future__ import annotations

import torch
from fronts import PlainFront
from torch import nn

from lightning_nanguard import NanGuard
from lightning_nanguard.core.event_builder import EventSections
from lightning_nanguard.decide.policy import StepHealth
from lightning_nanguard.engine.incident.inspector import IncidentInspector, loss_scale_event, with_rerun_note

BAD = StepHealth(True, float("nan"), False, False, False, 1.0, 1, 0, 0, 0)


class NoRerun(PlainFront):
    def cannot_rerun(self) -> str:
        return "naming samples needs NanGuard(loss_fn=...)"


def inspector(net: nn.Module, optimizer: int | None) -> IncidentInspector:
    controller = NanGuard(verbose=False, bisect=False, localize=False, save_repro=False).controller
    named = list(net.named_parameters())
    return IncidentInspector(controller.diagnosis, controller.window, named, controller.recorder, optimizer=optimizer)


def test_the_event_names_the_optimizer_the_front_end_gave_and_what_was_found() -> None:
    net = nn.Linear(2, 1)
    net(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    vote, event = inspector(net, optimizer=1).inspect(PlainFront(net, global_step=4), BAD, grads)
    assert event is not None and vote.incident
    assert (event.global_step, event.optimizer, event.kinds) == (4, 1, ("grad",))
    assert event.nonfinite_grads == ("weight",) and event.action == "warned"  # decided later
    sections = EventSections.of(event)
    assert sections.found.details == {"grads_checked": 2, "buffers_checked": 0}
    _, unknown = inspector(net, optimizer=None).inspect(PlainFront(net), BAD, grads)
    assert unknown is not None and unknown.optimizer is None


def test_a_loop_that_cannot_rerun_says_why_no_sample_is_named_in_the_rows() -> None:
    net = nn.Linear(2, 1)
    event = loss_scale_event(None, 4, 0.5, 20, None, optimizer=0)
    noted = with_rerun_note(NoRerun(net), event)
    assert noted is not None and noted.optimizer == 0
    assert EventSections.of(noted).rows.details == {"samples_not_named": "naming samples needs NanGuard(loss_fn=...)"}
    assert EventSections.of(noted).forensics.details["hint"].startswith("the loss scale collapsed")
    assert noted.details["loss_scale"] == 0.5 and noted.details["consecutive_overflows"] == 20
