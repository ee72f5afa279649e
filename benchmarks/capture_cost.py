"""What capturing a step for a possible skip costs: ``self.log`` aggregates and torchmetrics states.

Run from the repository root::

    python -m benchmarks.capture_cost

A module that logs four values (mean, sum, max, min; ``on_epoch=True``) and updates two torchmetrics
metrics (``MeanSquaredError``, ``MeanAbsoluteError``) every step: the guard captures, at the start
of every checked step, the references to Lightning's four epoch aggregates
(:class:`~lightning_nanguard.trainer.logged_values.LoggedValues`) and the metrics' states
(:class:`~lightning_nanguard.recover.metrics.MetricStates`, one fused device copy). Printed: the
microseconds of each capture (median of repeated timings of many calls, side by side in one run),
and of one plain ``Tensor.copy_`` for scale. No host read happens in either capture.
"""

from __future__ import annotations

import statistics
import timeit
from types import SimpleNamespace

import torch
import torchmetrics
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_nanguard.recover.metrics import MetricStates
from lightning_nanguard.trainer.logged_values import LoggedValues


def main() -> None:
    torch.set_num_threads(1)
    metrics = torch.nn.ModuleDict({"mse": torchmetrics.MeanSquaredError(), "mae": torchmetrics.MeanAbsoluteError()})
    for metric in metrics.values():
        metric.update(torch.ones(4), torch.zeros(4))
    states = MetricStates(metrics)
    results = _ResultCollection(training=True)
    for fx in ("mean", "sum", "max", "min"):
        value = torch.tensor(1.0)
        results.log("training_step", f"loss_{fx}", value, on_step=False, on_epoch=True, reduce_fx=fx, batch_size=4)
    trainer = SimpleNamespace(_results=results)
    logged = LoggedValues()
    one, other = torch.zeros(()), torch.ones(())
    calls, repeats = 5000, 7
    timings = {
        "4 logged values (LoggedValues.capture)": lambda: logged.capture(trainer),
        "2 metrics, 4 tensor states (MetricStates.capture)": states.capture,
        "one 0-dim Tensor.copy_ (for scale)": lambda: one.copy_(other),
    }
    for name, call in timings.items():
        runs = timeit.repeat(call, number=calls, repeat=repeats)
        print(f"{name:55s} {statistics.median(runs) / calls * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
