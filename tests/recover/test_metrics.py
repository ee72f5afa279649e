"""MetricStates: torchmetrics states captured before a step and put back exactly, without copying lists."""

from __future__ import annotations

import torch
import torchmetrics
from torch import nn

from lightning_nanguard.recover.metrics import MetricStates


class FloatState(torchmetrics.Metric):
    """A custom metric whose update re-binds its state to a Python float (torchmetrics does not stop it)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x: torch.Tensor) -> None:
        self.total = float(self.total) + float(x.sum())  # type: ignore[assignment]

    def compute(self) -> torch.Tensor:
        return torch.tensor(float(self.total))


def module() -> nn.Module:
    return nn.ModuleDict(
        {
            "collection": torchmetrics.MetricCollection(
                {"mse": torchmetrics.MeanSquaredError(), "mae": torchmetrics.MeanAbsoluteError()}, compute_groups=True
            ),
            "nested": nn.ModuleList([torchmetrics.CatMetric(), torchmetrics.MeanMetric(), torchmetrics.MaxMetric()]),
        }
    )


def update(net: nn.Module, value: float) -> None:
    x = torch.tensor([value, 1.0])
    net["collection"](x, torch.zeros(2))  # forward: the batch value and the merged state
    net["nested"][0].update(x)
    net["nested"][1].update(x)
    net["nested"][2].update(x)


def states(net: nn.Module) -> list[object]:
    out: list[object] = []
    for name, metric in net.named_modules():
        if isinstance(metric, torchmetrics.Metric):
            for state in metric._defaults:
                value = getattr(metric, state)
                out.append((name, state, [v.tolist() for v in value] if isinstance(value, list) else value.tolist()))
            out.append((name, "_update_count", metric._update_count))
    return out


def test_every_kind_of_state_is_put_back_exactly() -> None:
    net = module()
    captured = MetricStates(net)
    assert [name for name, _ in captured.metrics] == [
        "collection.mae",
        "collection.mse",
        "nested.0",
        "nested.1",
        "nested.2",
    ]
    update(net, 2.0)
    captured.capture()
    before = states(net)
    computed = float(net["collection"]["mse"].compute())
    update(net, float("nan"))
    update(net, 7.0)
    captured.restore()
    assert states(net) == before
    assert float(net["collection"]["mse"].compute()) == computed
    update(net, 3.0)  # still a working metric after the restore
    assert net["nested"][0].compute().tolist() == [2.0, 1.0, 3.0, 1.0]


def test_list_states_are_cut_back_not_copied() -> None:
    net = module()
    captured = MetricStates(net)
    update(net, 1.0)
    captured.capture()
    kept = net["nested"][0].value[0]
    update(net, 2.0)
    captured.restore()
    assert len(net["nested"][0].value) == 1 and net["nested"][0].value[0] is kept


def test_restore_before_any_capture_changes_nothing() -> None:
    net = module()
    update(net, 1.0)
    before = states(net)
    MetricStates(net).restore()
    assert states(net) == before


def test_a_state_of_another_type_is_named_and_left_alone() -> None:
    net = nn.ModuleDict({"custom": FloatState(), "mse": torchmetrics.MeanSquaredError()})
    captured = MetricStates(net)
    assert [name for name, _ in captured.metrics] == ["custom", "mse"] and not captured.unsupported
    assert captured.capture() is False
    net["custom"].update(torch.ones(2))
    net["mse"].update(torch.ones(2), torch.zeros(2))
    assert captured.capture() is True  # found at the next capture: named, and no longer handled
    assert captured.unsupported == [("custom", "total", "float")]
    assert [name for name, _ in captured.metrics] == ["mse"]
    net["mse"].update(torch.full((2,), float("nan")), torch.zeros(2))
    net["custom"].update(torch.ones(2))  # the skipped step updates the unsupported metric too
    captured.restore()  # the other metrics are still restored
    assert float(net["mse"].compute()) == 1.0
    assert float(net["custom"].compute()) == 4.0  # as the notice says: its value includes the skipped step
    sentence = captured.describe_unsupported()
    assert sentence is not None and "custom.total (float)" in sentence and "include skipped steps" in sentence


def test_a_module_without_metrics_has_nothing_to_do() -> None:
    captured = MetricStates(nn.Linear(2, 2))
    assert not captured and captured.describe_unsupported() is None
    captured.capture()
    captured.restore()
