"""The step policy (``lightning_nanguard.decide.policy``): one decision for every rank from every rank's report.

Without a Trainer: the host-read layout (``local_vector``/``shared_part``/``StepHealth``), the
outcomes of ``decide`` and the counters after them, the escalation rules, ``decide_weights``, and
reports of several ranks that disagree (which cause wins, what is quarantined, whose culprit).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_nanguard.decide.policy import (
    LOCAL_FIELDS,
    SHARED_FIELDS,
    Counters,
    Policy,
    RankVote,
    StepHealth,
    decide,
    decide_weights,
    local_vector,
    shared_part,
)

CAUSES = ("state", "input", "data", "interaction", "batch")
"""From the strongest cause to the weakest: the shared cause is the strongest any incident rank gave."""


def incident(rank: int = 0, **fields: object) -> RankVote:
    return RankVote(rank=rank, incident=True, **fields)  # type: ignore[arg-type]


def run(steps: int, reports: list[RankVote], policy: Policy, counters: Counters | None = None) -> list:
    """``decide`` the same reports ``steps`` times in a row; the ``(decision, counters)`` of each step."""
    counters = counters or Counters()
    out = []
    for _ in range(steps):
        decision, counters = decide(reports, counters, policy)
        out.append((decision, counters))
    return out


# ------------------------------------------------------------------------------------ the host read


def test_local_vector_layout() -> None:
    summary = torch.tensor([1.0, 2.5, 1.0], dtype=torch.float64)
    vector = local_vector(summary, spike=torch.tensor([True]), failed=True, loss=torch.tensor(0.75), part_failed=True)
    assert vector.dtype == torch.float32 and vector.shape == (len(LOCAL_FIELDS),)
    assert dict(zip(LOCAL_FIELDS, vector.tolist(), strict=True)) == {
        "bad": 1.0,
        "grad_norm": 2.5,
        "others_bad": 1.0,
        "spike": 1.0,
        "failed": 1.0,
        "loss": 0.75,
        "part_failed": 1.0,
    }


def test_local_vector_defaults_no_spike_not_failed_and_a_nan_loss() -> None:
    values = local_vector(torch.tensor([0.0, -1.0, 0.0])).tolist()
    assert values[:5] == [0.0, -1.0, 0.0, 0.0, 0.0]
    assert math.isnan(values[5]) and values[6] == 0.0


def test_local_vector_flag_tensors_are_never_written() -> None:
    """The cached constant flags are shared by every step: a later vector must not alias them."""
    first = local_vector(torch.tensor([0.0, 1.0, 0.0]))
    first.add_(5.0)
    assert local_vector(torch.tensor([0.0, 1.0, 0.0])).tolist()[3:5] == [0.0, 0.0]


def test_shared_part_takes_the_shared_fields_of_the_local_vector() -> None:
    vector = torch.tensor([1.0, 9.0, 2.0, 3.0, 4.0, 0.5, 5.0])
    assert shared_part(vector).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [vector[LOCAL_FIELDS.index(name)].item() for name in SHARED_FIELDS] == shared_part(vector).tolist()


def test_step_health_without_the_shared_part_counts_this_rank_only() -> None:
    health = StepHealth.from_values([1.0, 3.5, 1.0, 0.0, 0.0, 0.25, 0.0])
    assert (health.bad, health.others_bad, health.spike, health.failed) == (True, True, False, False)
    assert (health.grad_norm, health.loss) == (3.5, 0.25)
    assert (health.ranks_bad, health.ranks_others_bad, health.ranks_spike, health.ranks_failed) == (1, 1, 0, 0)
    assert not health.healthy


def test_step_health_with_the_shared_part_counts_every_rank() -> None:
    """This rank is fine; two ranks flagged NaN/Inf, one of them in its loss, one spiked."""
    health = StepHealth.from_values([0.0, 1.5, 0.0, 0.0, 0.0, 0.7, 0.0, 2.0, 1.0, 1.0, 0.0, 0.0])
    assert (health.bad, health.others_bad, health.spike, health.failed) == (False, False, False, False)
    assert (health.ranks_bad, health.ranks_others_bad, health.ranks_spike, health.ranks_failed) == (2, 1, 1, 0)
    assert not health.healthy


def test_step_health_round_trips_a_local_vector_and_its_shared_part() -> None:
    local = local_vector(torch.tensor([1.0, 4.0, 0.0]), spike=torch.tensor([1.0]), loss=torch.tensor(2.0))
    alone = StepHealth.from_values(local.tolist())
    with_shared = StepHealth.from_values(torch.cat((local, shared_part(local))).tolist())
    assert alone == with_shared


@pytest.mark.parametrize(
    ("shared", "healthy"),
    [
        ([0, 0, 0, 0, 0], True),
        ([0, 3, 0, 0, 0], True),  # others_bad alone never comes without bad; it does not decide health
        ([0, 0, 0, 0, 2], True),  # a part switched off elsewhere: the step itself is fine
        ([1, 0, 0, 0, 0], False),
        ([0, 0, 1, 0, 0], False),
        ([0, 0, 0, 1, 0], False),
    ],
)
def test_healthy_means_no_rank_flagged_bad_spike_or_failure(shared: list[int], healthy: bool) -> None:
    assert StepHealth.from_values([0, 1.0, 0, 0, 0, 0.5, 0, *shared]).healthy is healthy


# ------------------------------------------------------------------------------------ healthy steps


def test_a_healthy_step_ends_every_run_and_keeps_the_totals() -> None:
    counters = Counters(
        bad_steps_total=4,
        skipped_total=3,
        consecutive_bad_steps=2,
        amp_overflow_total=5,
        consecutive_overflows=1,
        spikes_total=6,
        consecutive_spikes=2,
    )
    decision, after = decide([], counters, Policy())
    assert (decision.outcome, decision.action, decision.discard, decision.bad) == ("healthy", None, False, False)
    assert after == Counters(bad_steps_total=4, skipped_total=3, amp_overflow_total=5, spikes_total=6)
    assert after == counters.healthy()


def test_reports_that_found_nothing_are_a_healthy_step() -> None:
    reports = [RankVote(rank=0), RankVote(rank=1)]
    decision, after = decide(reports, Counters(consecutive_bad_steps=1), Policy())
    assert decision.outcome == "healthy" and decision.reports == tuple(reports)
    assert after.consecutive_bad_steps == 0


# ------------------------------------------------------------------------------------ incidents and actions


@pytest.mark.parametrize(
    ("action", "discard", "skipped"),
    [("skip", True, 1), ("rollback", True, 1), ("raise", True, 0), ("warn", False, 0)],
)
def test_an_incident_takes_the_configured_action(action: str, discard: bool, skipped: int) -> None:
    before = Counters(bad_steps_total=2, consecutive_spikes=3, amp_overflow_total=1)
    decision, after = decide([incident(cause="data")], before, Policy(action=action))  # type: ignore[arg-type]
    assert (decision.outcome, decision.action, decision.discard, decision.bad) == ("incident", action, discard, True)
    assert decision.escalation is None and not decision.rollback_due
    assert after == Counters(
        bad_steps_total=3, skipped_total=skipped, consecutive_bad_steps=1, amp_overflow_total=1, consecutive_spikes=0
    )


def test_rollback_is_due_after_rollback_after_consecutive_bad_steps_and_restarts_the_run() -> None:
    policy = Policy(action="rollback", rollback_after_consecutive=3, max_consecutive_bad_steps=10)
    steps = run(4, [incident(cause="state")], policy)
    assert [d.rollback_due for d, _ in steps] == [False, False, True, False]
    assert [c.consecutive_bad_steps for _, c in steps] == [1, 2, 0, 1]  # reset by the rollback
    assert [c.skipped_total for _, c in steps] == [1, 2, 3, 4]
    assert all(d.action == "rollback" and d.discard for d, _ in steps)


def test_rollback_never_comes_before_escalation() -> None:
    """When the run reaches both limits at once, the guard raises: the escalation is checked first."""
    policy = Policy(action="rollback", rollback_after_consecutive=3, max_consecutive_bad_steps=3)
    decision, counters = run(3, [incident()], policy)[-1]
    assert (decision.action, decision.escalation, decision.rollback_due) == (
        "raise",
        "max_consecutive_bad_steps",
        False,
    )
    assert counters.consecutive_bad_steps == 3 and counters.skipped_total == 2


@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_without_can_skip_skip_and_rollback_warn(action: str) -> None:
    """Manual optimisation and LBFGS: the update cannot be dropped from a hook."""
    policy = Policy(action=action, can_skip=False, rollback_after_consecutive=1)  # type: ignore[arg-type]
    decision, after = decide([incident()], Counters(), policy)
    assert (decision.action, decision.discard, decision.rollback_due) == ("warn", False, False)
    assert (after.skipped_total, after.consecutive_bad_steps, after.bad_steps_total) == (0, 1, 1)


def test_without_can_skip_raise_still_raises() -> None:
    decision, _ = decide([incident()], Counters(), Policy(action="raise", can_skip=False))
    assert (decision.action, decision.discard) == ("raise", True)
    escalated, _ = decide(
        [incident()], Counters(consecutive_bad_steps=1), Policy(can_skip=False, max_consecutive_bad_steps=2)
    )
    assert (escalated.action, escalated.escalation) == ("raise", "max_consecutive_bad_steps")


# ------------------------------------------------------------------------------------ escalation


@pytest.mark.parametrize("action", ["skip", "warn", "rollback"])
def test_max_consecutive_bad_steps_raises_at_the_limit(action: str) -> None:
    policy = Policy(action=action, max_consecutive_bad_steps=3, rollback_after_consecutive=100)  # type: ignore[arg-type]
    steps = run(3, [incident()], policy)
    assert [d.escalation for d, _ in steps] == [None, None, "max_consecutive_bad_steps"]
    assert [d.action for d, _ in steps] == [action, action, "raise"]
    assert steps[-1][0].discard


def test_a_healthy_step_between_bad_steps_restarts_the_consecutive_count() -> None:
    policy = Policy(max_consecutive_bad_steps=2)
    _, counters = decide([incident()], Counters(), policy)
    _, counters = decide([], counters, policy)
    decision, counters = decide([incident()], counters, policy)
    assert decision.escalation is None and counters.consecutive_bad_steps == 1 and counters.bad_steps_total == 2


def test_max_events_counts_every_bad_step_of_the_run() -> None:
    policy = Policy(max_events=3, max_consecutive_bad_steps=100)
    counters = Counters()
    escalations = []
    for _ in range(3):
        decision, counters = decide([incident()], counters, policy)
        escalations.append(decision.escalation)
        _, counters = decide([], counters, policy)
    assert escalations == [None, None, "max_events"]
    assert counters.bad_steps_total == 3 and counters.skipped_total == 2


def test_max_consecutive_bad_steps_is_named_before_max_events() -> None:
    decision, _ = decide(
        [incident()],
        Counters(bad_steps_total=9, consecutive_bad_steps=1),
        Policy(max_events=5, max_consecutive_bad_steps=2),
    )
    assert decision.escalation == "max_consecutive_bad_steps"


def test_no_max_events_never_escalates_on_the_total() -> None:
    decision, _ = decide([incident()], Counters(bad_steps_total=10**6), Policy(max_events=None))
    assert decision.escalation is None and decision.action == "skip"


# ------------------------------------------------------------------------------------ AMP overflow and loss scale


def test_an_overflow_is_counted_and_left_to_the_grad_scaler() -> None:
    before = Counters(consecutive_bad_steps=2, bad_steps_total=2, consecutive_spikes=1)
    decision, after = decide([RankVote(rank=0, overflow=True)], before, Policy(), next_loss_scale=2.0**15)
    assert (decision.outcome, decision.action, decision.discard, decision.bad) == ("overflow", None, False, False)
    assert after == before.replace(amp_overflow_total=1, consecutive_overflows=1)


@pytest.mark.parametrize(("scale", "outcome"), [(0.5, "loss_scale"), (1.0, "overflow"), (None, "overflow")])
def test_a_loss_scale_below_min_loss_scale_is_an_incident(scale: float | None, outcome: str) -> None:
    decision, after = decide([RankVote(rank=0, overflow=True)], Counters(), Policy(min_loss_scale=1.0), scale)
    assert decision.outcome == outcome
    assert after.amp_overflow_total == 1 and after.consecutive_overflows == 1
    if outcome == "loss_scale":
        assert (decision.bad, decision.action, decision.discard) == (True, "skip", True)
        assert (after.bad_steps_total, after.consecutive_bad_steps, after.skipped_total) == (1, 1, 1)
    else:
        assert after.bad_steps_total == 0


def test_max_consecutive_overflows_is_a_loss_scale_incident() -> None:
    policy = Policy(max_consecutive_overflows=3)
    steps = run(3, [RankVote(rank=0, overflow=True)], policy)
    assert [d.outcome for d, _ in steps] == ["overflow", "overflow", "loss_scale"]
    assert [c.consecutive_overflows for _, c in steps] == [1, 2, 3]
    _, after = decide([], steps[-1][1], policy)
    assert after.consecutive_overflows == 0 and after.amp_overflow_total == 3


def test_a_collapsed_loss_scale_escalates_like_any_incident() -> None:
    decision, _ = decide(
        [RankVote(rank=0, overflow=True)], Counters(consecutive_bad_steps=1), Policy(max_consecutive_bad_steps=2), 0.0
    )
    assert (decision.outcome, decision.action, decision.escalation) == (
        "loss_scale",
        "raise",
        "max_consecutive_bad_steps",
    )


# ------------------------------------------------------------------------------------ loss spikes


def test_a_spike_with_spike_action_skip_is_skipped_and_counted() -> None:
    spike = [RankVote(rank=0, spike=True, cause="data", quarantine=(4, 2))]
    decision, after = decide(spike, Counters(consecutive_bad_steps=1, bad_steps_total=1), Policy(spike_action="skip"))
    assert (decision.outcome, decision.action, decision.discard, decision.bad) == ("spike", "skip", True, False)
    assert (decision.cause, decision.quarantine, decision.rebaseline) == ("data", (2, 4), False)
    assert after == Counters(
        bad_steps_total=1, skipped_total=1, consecutive_bad_steps=1, spikes_total=1, consecutive_spikes=1
    )


def test_a_spike_with_spike_action_warn_is_applied_and_counted() -> None:
    decision, after = decide([RankVote(rank=0, spike=True)], Counters(), Policy(spike_action="warn"))
    assert (decision.outcome, decision.action, decision.discard) == ("spike", "warn", False)
    assert (after.spikes_total, after.consecutive_spikes, after.skipped_total) == (1, 1, 0)


def test_a_spike_with_spike_action_off_is_a_healthy_step() -> None:
    decision, after = decide([RankVote(rank=0, spike=True)], Counters(consecutive_spikes=2), Policy(spike_action="off"))
    assert (decision.outcome, decision.action, decision.discard) == ("healthy", None, False)
    assert (after.spikes_total, after.consecutive_spikes) == (0, 0)


def test_a_spike_without_can_skip_warns() -> None:
    decision, after = decide([RankVote(rank=0, spike=True)], Counters(), Policy(spike_action="skip", can_skip=False))
    assert (decision.action, decision.discard, after.skipped_total) == ("warn", False, 0)


def test_spikes_in_a_row_rebaseline_the_statistic() -> None:
    """After ``spike_rebaseline_after`` spikes in a row the new level is the norm: start the statistic over."""
    policy = Policy(spike_rebaseline_after=3)
    steps = run(5, [RankVote(rank=0, spike=True)], policy)
    assert [d.rebaseline for d, _ in steps] == [False, False, True, False, False]
    assert [c.consecutive_spikes for _, c in steps] == [1, 2, 0, 1, 2]
    assert [c.spikes_total for _, c in steps] == [1, 2, 3, 4, 5]
    assert [c.skipped_total for _, c in steps] == [1, 2, 3, 4, 5]


def test_a_healthy_step_between_spikes_restarts_the_run_of_spikes() -> None:
    policy = Policy(spike_rebaseline_after=2)
    _, counters = decide([RankVote(rank=0, spike=True)], Counters(), policy)
    _, counters = decide([], counters, policy)
    decision, counters = decide([RankVote(rank=0, spike=True)], counters, policy)
    assert not decision.rebaseline and counters.consecutive_spikes == 1


def test_spike_cause_and_quarantine_come_from_the_ranks_that_spiked() -> None:
    reports = [
        RankVote(rank=0, spike=True, cause="interaction", quarantine=(8,)),
        RankVote(rank=1, cause="state", quarantine=(99,)),  # did not spike: not counted
        RankVote(rank=2, spike=True, cause="data", quarantine=(3, 8)),
    ]
    decision, _ = decide(reports, Counters(), Policy())
    assert (decision.outcome, decision.cause, decision.quarantine) == ("spike", "data", (3, 8))


# ------------------------------------------------------------------------------------ internal failures


@pytest.mark.parametrize(
    ("found", "outcome"),
    [
        ({}, "failed"),  # a rank that could not check: the step is not vouched for, so it is dropped
        ({"incident": True}, "incident"),
        ({"overflow": True}, "failed"),
        ({"spike": True}, "failed"),
    ],
)
@pytest.mark.parametrize("failed_rank", [0, 1])
def test_any_failed_rank_drops_the_step_and_disables_every_guard(
    found: dict[str, bool], outcome: str, failed_rank: int
) -> None:
    reports = [RankVote(rank=0, failed=failed_rank == 0, **found), RankVote(rank=1, failed=failed_rank == 1)]  # type: ignore[arg-type]
    decision, counters = decide(reports, Counters(), Policy())
    assert decision.outcome == outcome and decision.disable
    assert decision.discard and decision.action == "skip" and counters.skipped_total == 1


def test_a_failed_rank_under_manual_optimisation_cannot_drop_and_says_so() -> None:
    decision, counters = decide([RankVote(rank=0, failed=True)], Counters(), Policy(can_skip=False))
    assert (decision.outcome, decision.action, decision.discard, counters.skipped_total) == ("failed", "warn", False, 0)


def test_no_failed_rank_disables_nothing() -> None:
    decision, _ = decide([incident(0), RankVote(rank=1, spike=True)], Counters(), Policy())
    assert not decision.disable


# ------------------------------------------------------------------------------------ ranks that disagree


@pytest.mark.parametrize(("first", "second"), list(itertools.permutations(CAUSES, 2)))
@pytest.mark.parametrize("ranks", [(0, 1), (1, 0), (3, 1), (0, 7)], ids=["0-1", "1-0", "3-1", "0-7"])
def test_the_shared_cause_is_the_strongest_of_two_ranks(first: str, second: str, ranks: tuple[int, int]) -> None:
    """``state`` > ``input`` > ``data`` > ``interaction`` > ``batch``, whichever rank said it and in whichever order."""
    expected = min((first, second), key=CAUSES.index)
    reports = [incident(ranks[0], cause=first), incident(ranks[1], cause=second)]
    for ordered in (reports, reports[::-1]):
        decision, _ = decide(ordered, Counters(), Policy())
        assert (decision.outcome, decision.cause) == ("incident", expected)


@pytest.mark.parametrize(("stronger", "weaker"), list(itertools.combinations(CAUSES, 2)))
@pytest.mark.parametrize("position", range(4))
def test_the_stronger_cause_wins_at_any_rank_among_four(stronger: str, weaker: str, position: int) -> None:
    """One rank's stronger cause among three ranks of the weaker one, and ranks that found nothing."""
    reports = [incident(rank, cause=weaker) for rank in range(4)]
    reports[position] = incident(position, cause=stronger)
    reports.append(RankVote(rank=4))  # healthy rank
    reports.append(incident(5, cause=None))  # NaN/Inf not investigated
    decision, _ = decide(reports, Counters(), Policy())
    assert decision.cause == stronger


@pytest.mark.parametrize("order", list(itertools.permutations(CAUSES)))
def test_every_cause_at_once_is_the_model_state(order: tuple[str, ...]) -> None:
    reports = [incident(rank, cause=cause) for rank, cause in enumerate(order)]
    assert decide(reports, Counters(), Policy())[0].cause == "state"


@pytest.mark.parametrize("cause", CAUSES)
def test_a_rank_whose_incident_was_not_investigated_does_not_hide_a_cause(cause: str) -> None:
    for reports in ([incident(0), incident(1, cause=cause)], [incident(0, cause=cause), incident(1)]):
        assert decide(reports, Counters(), Policy())[0].cause == cause
    assert decide([incident(0), incident(1)], Counters(), Policy())[0].cause is None


@pytest.mark.parametrize("cause", CAUSES)
def test_a_cause_without_an_incident_does_not_count(cause: str) -> None:
    """A rank that only spiked (``incident=False``) may carry a cause: it is not the incident's."""
    reports = [RankVote(rank=0, spike=True, cause="state"), incident(1, cause=cause)]
    for ordered in (reports, reports[::-1]):
        assert decide(ordered, Counters(), Policy())[0].cause == cause
    only_other = [RankVote(rank=0, cause="state"), incident(1)]
    assert decide(only_other, Counters(), Policy())[0].cause is None


@pytest.mark.parametrize(
    ("reports", "quarantine"),
    [
        ([incident(0, cause="data", quarantine=(9, 4)), incident(1, cause="input", quarantine=(4, 1))], (1, 4, 9)),
        ([incident(0, cause="data", quarantine=(7,)), incident(1, cause="state", quarantine=(2,))], (7,)),
        ([incident(0, cause="interaction", quarantine=(3, 5)), incident(1, cause="data", quarantine=(6,))], (6,)),
        ([incident(0, cause=None, quarantine=(8,)), incident(1, cause="input", quarantine=(0,))], (0,)),
        ([incident(0, cause="state", quarantine=(1,)), incident(1, cause="interaction", quarantine=(2,))], ()),
        ([incident(2, cause="data", quarantine=(5, 5)), incident(0, cause="data", quarantine=(5, 3))], (3, 5)),
    ],
    ids=["data+input", "data+state", "interaction+data", "none+input", "state+interaction", "duplicates"],
)
def test_quarantine_is_the_sorted_union_over_data_and_input_ranks(
    reports: list[RankVote], quarantine: tuple[int, ...]
) -> None:
    for ordered in (reports, reports[::-1]):
        assert decide(ordered, Counters(), Policy())[0].quarantine == quarantine


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_the_culprit_module_is_the_lowest_reporting_ranks_whatever_the_order(order: tuple[int, ...]) -> None:
    culprits = {0: None, 1: "encoder.norm", 2: "decoder.attn", 3: "head"}
    reports = [incident(rank, culprit_module=culprits[rank]) for rank in order]
    assert decide(reports, Counters(), Policy())[0].culprit_module == "encoder.norm"


def test_no_culprit_module_from_any_rank_is_none() -> None:
    assert decide([incident(1), incident(0)], Counters(), Policy())[0].culprit_module is None


@pytest.mark.parametrize("incident_rank", [0, 1])
def test_an_incident_on_one_rank_and_an_overflow_on_another_is_an_incident(incident_rank: int) -> None:
    reports = [RankVote(rank=0, overflow=True), RankVote(rank=1, overflow=True)]
    reports[incident_rank] = incident(incident_rank, cause="data", quarantine=(3,))
    decision, after = decide(reports, Counters(consecutive_overflows=4), Policy(), next_loss_scale=0.0)
    assert (decision.outcome, decision.action, decision.cause, decision.quarantine) == (
        "incident",
        "skip",
        "data",
        (3,),
    )
    assert (after.bad_steps_total, after.amp_overflow_total, after.consecutive_overflows) == (1, 0, 4)


@pytest.mark.parametrize("incident_rank", [0, 1])
def test_a_spike_on_one_rank_and_an_incident_on_another_is_an_incident(incident_rank: int) -> None:
    reports = [RankVote(rank=0, spike=True, cause="data"), RankVote(rank=1, spike=True, cause="data")]
    reports[incident_rank] = incident(incident_rank, cause="interaction")
    decision, after = decide(reports, Counters(consecutive_spikes=2, spikes_total=2), Policy(spike_action="skip"))
    assert (decision.outcome, decision.cause, decision.rebaseline) == ("incident", "interaction", False)
    assert (after.spikes_total, after.consecutive_spikes, after.bad_steps_total) == (2, 0, 1)


def test_a_spike_on_one_rank_and_an_overflow_on_another_is_an_overflow() -> None:
    reports = [RankVote(rank=0, spike=True), RankVote(rank=1, overflow=True)]
    decision, after = decide(reports, Counters(), Policy())
    assert decision.outcome == "overflow" and after.spikes_total == 0


def test_every_rank_gets_the_same_decision_from_the_same_reports() -> None:
    """Each rank decides alone from the gathered reports: the list is the same on every rank, so is the result."""
    reports = [
        incident(1, cause="data", quarantine=(4,), culprit_module="b"),
        RankVote(rank=0, overflow=True),
        incident(2, cause="state", culprit_module="c"),
    ]
    counters = Counters(consecutive_bad_steps=1, bad_steps_total=5)
    results = {decide(reports, counters, Policy(action="rollback", rollback_after_consecutive=2)) for _ in range(3)}
    assert len(results) == 1
    ((decision, after),) = results
    assert (decision.cause, decision.quarantine, decision.culprit_module, decision.rollback_due) == (
        "state",
        (4,),
        "b",
        True,
    )
    assert decision.reports == tuple(reports) and after.consecutive_bad_steps == 0


# ------------------------------------------------------------------------------------ weights after the update


@pytest.mark.parametrize(
    ("action", "snapshot", "expected"),
    [
        ("rollback", True, "rollback"),
        ("rollback", False, "raise"),
        ("warn", True, "warn"),
        ("warn", False, "warn"),
        ("skip", True, "raise"),
        ("raise", True, "raise"),
    ],
)
def test_decide_weights(action: str, snapshot: bool, expected: str) -> None:
    before = Counters(bad_steps_total=2, consecutive_bad_steps=1, skipped_total=2)
    decided, after = decide_weights(before, action, snapshot_available=snapshot)
    assert decided == expected
    assert after == before.replace(bad_steps_total=3)
