"""Each failure class of ``tests/helpers/models.py``: the model itself (plain PyTorch), then NanGuard on a real Trainer.

With ``action="skip"`` the bad step must leave parameters, optimizer state and BatchNorm buffers
bitwise untouched, the event must name exactly the broken tensors, and training must go on.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from fitting import fit
from models import BATCH_SIZE, KINDS, FailureCase, make_case, make_loader, make_module, make_net, origin_line
from torch import Tensor

from lightning_nanguard import NanGuard, read_events

NONFINITE = pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
CLASS_KINDS = tuple(kind for kind in KINDS if kind != "input_data")
N_STEPS = 4  # 32 samples / batch size 8, one epoch
BAD_STEP = 1  # sample 11 sits in the second batch


# ------------------------------------------------------------------------------------ the models alone


def _backward(net: torch.nn.Module, batch: Any) -> tuple[Tensor, list[str], list[str]]:
    net.zero_grad(set_to_none=True)
    loss = net.loss(batch)  # type: ignore[operator]
    loss.backward()
    bad_grads = [n for n, p in net.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    bad_buffers = [n for n, b in net.named_buffers() if b.is_floating_point() and not torch.isfinite(b).all()]
    return loss.detach(), bad_grads, bad_buffers


def _all_cases() -> list[Any]:
    cases = [pytest.param(kind, None, id=kind) for kind in CLASS_KINDS]
    for value, name in ((math.nan, "nan"), (math.inf, "+inf"), (-math.inf, "-inf")):
        cases.append(pytest.param("input_data", value, id=f"input_data-{name}"))
    return cases


@pytest.mark.parametrize(("kind", "value"), _all_cases())
def test_model_fails_exactly_on_its_bad_batch(kind: str, value: float | None) -> None:
    case = make_case(kind, value=value)
    net = make_net(kind)
    for batch_idx, batch in enumerate(make_loader(case.dataset)):
        state = {k: v.clone() for k, v in net.state_dict().items()}
        loss, bad_grads, bad_buffers = _backward(net, batch)
        net.load_state_dict(state)
        if batch_idx in case.bad_batches:
            prefixed_grads = tuple(f"net.{n}" for n in bad_grads)
            prefixed_buffers = tuple(f"net.{n}" for n in bad_buffers)
            assert prefixed_grads == case.nonfinite_grads
            assert prefixed_buffers == case.nonfinite_buffers
            assert math.isfinite(loss.item()) == case.finite_loss
        else:
            assert (bad_grads, bad_buffers) == ([], []), f"batch {batch_idx} should be healthy"
            assert math.isfinite(loss.item())


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("bn_overflow", "input_data")])
def test_model_fails_exactly_on_its_bad_samples(kind: str) -> None:
    """Sample by sample (no BatchNorm in these models): the non-finite samples are exactly ``bad_indices``."""
    case = make_case(kind, bad=(3, 20))
    net = make_net(kind)
    bad = []
    for index in range(len(case.dataset)):
        sample = tuple(t.unsqueeze(0) for t in case.dataset[index])
        loss, bad_grads, _ = _backward(net, sample)
        if bad_grads or not math.isfinite(loss.item()):
            bad.append(index)
    assert tuple(bad) == (3, 20)


def test_bn_overflow_needs_the_corrupted_sample_only() -> None:
    """The running_var overflow comes from the one corrupted sample: without it every batch is healthy."""
    healthy = make_case("bn_overflow", bad=())
    net = make_net("bn_overflow")
    for batch in make_loader(healthy.dataset):
        _, bad_grads, bad_buffers = _backward(net, batch)
        assert (bad_grads, bad_buffers) == ([], [])
    corrupt = make_case("bn_overflow", value=3e38)  # near float32 max: still finite grads
    net = make_net("bn_overflow")
    batch = list(make_loader(corrupt.dataset))[BAD_STEP]
    loss, bad_grads, bad_buffers = _backward(net, batch)
    assert math.isfinite(loss.item())
    assert bad_grads == []
    assert bad_buffers == ["input_bn.running_var"]
    assert torch.isfinite(net.input_bn.running_mean).all()  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["cosine_norm", "power_pool", "masked_div", "acos"])
def test_backward_origin_is_the_marked_op(kind: str) -> None:
    """The first backward node turning finite gradients into NaN/Inf is ``case.culprit_op``."""
    case = make_case(kind)
    net = make_net(kind)
    batch = list(make_loader(case.dataset))[BAD_STEP]
    loss = net.loss(batch)  # type: ignore[operator]
    order: list[tuple[str, bool, bool]] = []

    def finite(tensors: tuple[Tensor | None, ...]) -> bool:
        return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)

    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_hook(lambda gi, go, node=node: order.append((node.name(), finite(go), finite(gi))))
        stack.extend(fn for fn, _ in node.next_functions)
    loss.backward()
    first = next(name for name, ok_in, ok_out in order if ok_in and not ok_out)
    assert first == case.culprit_op


@pytest.mark.parametrize(
    ("origin", "needle"),
    [
        ("cosine_norm", ".sqrt()"),
        ("power_pool", ".pow(1.0 / self.p)"),
        ("bn_overflow", "self.input_bn(x)"),
        ("masked_div", "a / count"),
        ("acos", "torch.acos("),
        ("log_zero", "probs.log()"),
        ("input_data", "self(x)"),
    ],
)
def test_origin_line_points_at_the_op(origin: str, needle: str) -> None:
    lines = (Path(__file__).resolve().parents[1] / "helpers" / "models.py").read_text(encoding="utf-8").splitlines()
    line = origin_line(origin)
    assert needle in lines[line - 1]
    assert lines[line - 1].rstrip().endswith(f"# ORIGIN: {origin}")


def test_origin_line_unknown_name() -> None:
    with pytest.raises(LookupError, match="nonexistent"):
        origin_line("nonexistent")


# ------------------------------------------------------------------------------------ with the guard


def _fit(root: Path, recorder: Any, case: FailureCase, ns_name: str, **guard_kwargs: Any) -> tuple[Any, Any]:
    guard = NanGuard(**guard_kwargs)
    module = make_module(ns_name, case.kind)
    trainer, _ = fit(
        module, make_loader(case.dataset), root=root, guard=guard, callbacks=[recorder], ns=ns_name, require_active=True
    )
    return guard, trainer


def _assert_skipped_correctly(case: FailureCase, guard: NanGuard, trainer: Any, recorder: Any, root: Path) -> None:
    module = trainer.lightning_module
    assert trainer.global_step == N_STEPS  # a skipped step still counts as a step

    # The event names exactly what broke.
    assert len(guard.events) == 1
    event = guard.events[0]
    assert (event.global_step, event.epoch, event.batch_idx, event.rank) == (BAD_STEP, 0, BAD_STEP, 0)
    assert event.action == "skipped"
    assert event.kinds == case.kinds
    assert event.nonfinite_grads == case.nonfinite_grads
    assert event.nonfinite_buffers == case.nonfinite_buffers
    assert event.loss is not None
    assert math.isfinite(event.loss) == case.finite_loss
    assert (guard.bad_steps_total, guard.skipped_total, guard.consecutive_bad_steps) == (1, 1, 0)

    # The bad step changed nothing: parameters, optimizer state, BatchNorm buffers are bitwise equal.
    bad = recorder.by_step(BAD_STEP)
    assert bad.batch_idx == BAD_STEP
    assert bad.changed_params() == []
    assert bad.unchanged()
    if module.optimizer_name == "adam":
        assert bad.adam_steps("before") == bad.adam_steps("after") == [1.0] * len(bad.params_before)
    if case.has_batchnorm:
        assert bad.buffers_before  # there is something to restore, and it was restored bitwise
        assert all(torch.equal(b, bad.buffers_after[n]) for n, b in bad.buffers_before.items())

    # Healthy steps before and after the bad one train every parameter normally.
    all_params = list(bad.params_before)
    for step in (0, 2, 3):
        record = recorder.by_step(step)
        assert record.changed_params() == all_params, f"step {step}"
        if module.optimizer_name == "adam":
            assert record.adam_steps("after") == [float(step if step < BAD_STEP else step - 1) + 1] * len(all_params)
        if case.has_batchnorm:
            before, after = record.buffers_before, record.buffers_after
            assert not all(torch.equal(before[n], after[n]) for n in before)

    # Everything is finite at the end.
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        assert torch.isfinite(tensor).all(), name

    # The same event is in events.jsonl (logger=False: under default_root_dir).
    assert [e.to_dict() for e in read_events(root / "nanguard" / "events.jsonl")] == [e.to_dict() for e in guard.events]
    assert recorder.progress_bar[BAD_STEP + 1]["nan_skipped"] == 1.0
    assert "nan_skipped" not in recorder.progress_bar[BAD_STEP]


@pytest.mark.parametrize("kind", CLASS_KINDS)
def test_guard_skips_failure_class(kind: str, ns_name: str, recorder: Any, tmp_path: Path) -> None:
    case = make_case(kind)
    guard, trainer = _fit(tmp_path, recorder, case, ns_name, verbose=False)
    _assert_skipped_correctly(case, guard, trainer, recorder, tmp_path)


@NONFINITE
def test_guard_skips_nonfinite_input_data(value: float, ns_name: str, recorder: Any, tmp_path: Path) -> None:
    case = make_case("input_data", value=value)
    guard, trainer = _fit(tmp_path, recorder, case, ns_name, verbose=False)
    _assert_skipped_correctly(case, guard, trainer, recorder, tmp_path)
    assert math.isnan(guard.events[0].loss)  # type: ignore[arg-type]


def test_guard_without_guard_the_model_is_destroyed(make_trainer: Any, ns_name: str) -> None:
    """Control experiment: the same run without NanGuard ends with non-finite weights."""
    case = make_case("cosine_norm")
    module = make_module(ns_name, "cosine_norm")
    make_trainer().fit(module, make_loader(case.dataset))
    assert not torch.isfinite(module.net.feature.weight).all()


def test_guard_two_bad_batches_in_one_epoch(ns_name: str, recorder: Any, tmp_path: Path) -> None:
    """Bad samples in batches 0 and 2: two separate events, each at its own step, none consecutive."""
    case = make_case("masked_div", bad=(2, 2 * BATCH_SIZE + 5))
    guard, _ = _fit(tmp_path, recorder, case, ns_name, verbose=False)
    assert [(e.global_step, e.batch_idx) for e in guard.events] == [(0, 0), (2, 2)]
    assert (guard.bad_steps_total, guard.skipped_total, guard.consecutive_bad_steps) == (2, 2, 0)
    assert recorder.by_step(0).unchanged()
    assert recorder.by_step(0).optimizer_after["state"] == {}  # Adam never ran: no state at all
    assert recorder.by_step(2).unchanged()
    assert recorder.by_step(1).adam_steps("after") == [1.0] * 3
    assert recorder.by_step(3).adam_steps("after") == [2.0] * 3
