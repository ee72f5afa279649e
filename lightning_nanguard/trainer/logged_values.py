"""What ``self.log`` accumulated for the epoch: captured before a step, put back when the step is dropped.

``self.log(..., on_epoch=True)`` adds each value to an epoch aggregate inside ``training_step``
(Lightning's private ``trainer._results``: one ``_ResultMetric`` per key, states ``value`` and, for
a mean, ``cumulated_batch_size``), so by the time the guard decides to drop a step its values are
already in. Every update *re-binds* those states (``self.value = self.value + value * batch_size``,
``reduce_fx(self.value, value)``), never writes into them, so keeping references is a complete,
copy-free snapshot: :meth:`LoggedValues.capture` keeps them at the start of a checked step (a few
attribute reads per key, no kernel, no host read), :meth:`LoggedValues.restore` re-binds them when
the step is dropped. The mean, sum, max and min reductions, ``sync_dist`` (synced at compute time)
and ``self.log_dict`` are all covered; keys first logged by the dropped step are withdrawn.

What a dropped step leaves:

- epoch values (``train_loss_epoch``, monitors of ``EarlyStopping``, ``ModelCheckpoint``, LR
  schedulers, the progress bar and loggers at epoch end) are computed over the applied steps only;
- the step-level value (``on_step=True``) of the dropped step is its real value, shown and logged
  at that step like any other (the guard's event says the step was dropped);
- an epoch whose every step was dropped has no epoch value: loggers get no epoch point, and
  ``trainer.callback_metrics`` keeps the last epoch's value (monitors see no improvement);
- when the epoch's last step was dropped, a step-level value (``on_step=True, on_epoch=False``) that
  monitors read at epoch end (``EarlyStopping``, ``ModelCheckpoint`` on a step metric) is the last
  applied step's again (:meth:`LoggedValues.settle_monitors`), not the dropped step's NaN.

The ``_ResultMetric`` layout was checked on Lightning 2.6.6 (``lightning.pytorch`` and
``pytorch_lightning``); where it differs, :meth:`LoggedValues.capture` gives up with one warning.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoggedValues"]

_WITHDRAWN = object()  # a key that did not hold a value at the capture


class LoggedValues:
    """The training epoch aggregates of ``self.log``, captured and restored by reference (see module docs).

    Attributes:
        unsupported: why the results cannot be handled on this Lightning version (``None``: they can);
            set at the first :meth:`capture` that meets an unexpected layout.

    Example:
        >>> from types import SimpleNamespace
        >>> import torch
        >>> metric = SimpleNamespace(value=torch.tensor(2.0), is_tensor=True, has_reset=False,
        ...                          _update_count=1, _computed=None)
        >>> trainer = SimpleNamespace(_results={"training_step.loss": metric})
        >>> logged = LoggedValues()
        >>> logged.capture(trainer)
        >>> metric.value = metric.value + float("nan")  # what the dropped step's self.log did
        >>> logged.restore(trainer)
        >>> metric.value.item()
        2.0
    """

    def __init__(self) -> None:
        self.unsupported: str | None = None
        self._saved: dict[str, Any] = {}
        self._withdrawn: list[Any] = []  # metrics to mark reset once the step-level values are out
        self._checked: dict[int, Any] = {}  # result metrics whose layout was checked, by id (Metric hashes its states)
        self._monitored: dict[str, Any] | None = None  # callback metrics as before the last dropped step

    @staticmethod
    def _results(trainer: Any) -> dict[str, Any] | None:
        """The training result collection: the fit loop's own (``trainer._results`` finds it by a slower path)."""
        try:  # plain attribute reads, at every checked step
            results = trainer.fit_loop.epoch_loop._results
        except AttributeError:
            results = None
        if results is None:
            results = getattr(trainer, "_results", None)
        return results if isinstance(results, dict) else None

    def capture(self, trainer: Any) -> None:
        """Keep the current epoch aggregates (references; call at the start of a checked step)."""
        if self._withdrawn:
            self.finish_withdrawals()
        saved: dict[str, Any] = {}
        self._saved = saved
        if self.unsupported is not None:
            return
        results = self._results(trainer)
        if results is None:
            self.unsupported = "the Trainer has no training result collection (`trainer._results`)"
            return
        checked = self._checked
        for key, metric in results.items():
            if id(metric) not in checked and not self._check(key, metric):
                self._saved = {}
                return
            if metric.has_reset:
                saved[key] = _WITHDRAWN
            else:
                value = metric.value
                cumulated = metric.__dict__.get("cumulated_batch_size")
                saved[key] = (value, cumulated, metric._update_count)

    def _check(self, key: str, metric: Any) -> bool:
        """Whether ``metric`` has the layout this module knows (checked once per result metric)."""
        known = all(hasattr(metric, name) for name in ("is_tensor", "has_reset", "value", "_update_count"))
        if not known:
            self.unsupported = f"the logged value {key!r} is a {type(metric).__name__} without value/has_reset"
            return False
        self._checked[id(metric)] = metric  # kept alive: its id stays its own
        return True

    def restore(self, trainer: Any) -> None:
        """Put the aggregates back as at :meth:`capture`; keys the dropped step logged first are withdrawn.

        A withdrawn key keeps its step-level value for this step's logging and is marked reset at
        the next :meth:`capture` or :meth:`finish_withdrawals` (the guard calls it at epoch end).
        """
        results = self._results(trainer)
        if results is None or self.unsupported is not None:
            return
        for key, metric in results.items():
            saved = self._saved.get(key, _WITHDRAWN)
            if saved is _WITHDRAWN:
                if metric.is_tensor:  # back to the defaults; the step-level value stays for this step's logging
                    forward_cache = getattr(metric, "_forward_cache", None)
                    metric.reset()
                    metric._forward_cache, metric.has_reset = forward_cache, False
                self._withdrawn.append(metric)
                continue
            value, cumulated, update_count = saved
            metric.value = value
            if cumulated is not None:
                metric.cumulated_batch_size = cumulated
            metric._update_count = update_count
            metric._computed = None

    def finish_withdrawals(self) -> None:
        """Mark the keys a dropped step logged first as not logged this epoch (after its step-level logging)."""
        for metric in self._withdrawn:
            metric.has_reset = True
        self._withdrawn = []

    def remember_monitors(self, trainer: Any) -> None:
        """Keep what monitors read (``trainer.callback_metrics``) as before a step that is being dropped.

        A shallow copy of a small dict, on dropped steps only; it is read lazily by Lightning, so at
        the decision it still holds the last applied step's values.
        """
        callback = _callback_metrics(trainer)
        self._monitored = dict(callback) if callback is not None else None

    def settle_monitors(self, trainer: Any, last_step_dropped: bool) -> None:
        """At epoch end: step-level values the monitors read are the last applied step's (see module docs)."""
        kept, self._monitored = self._monitored, None
        callback, results = _callback_metrics(trainer), self._results(trainer)
        if not last_step_dropped or kept is None or callback is None or results is None:
            return
        for metric in results.values():
            meta = getattr(metric, "meta", None)
            if meta is None or not getattr(meta, "on_step", False) or getattr(meta, "on_epoch", True):
                continue  # epoch values are computed again from the restored aggregates
            name = getattr(meta, "name", None)
            if name in kept:
                callback[name] = kept[name]
            elif name in callback:
                del callback[name]  # first logged by the dropped step


def _callback_metrics(trainer: Any) -> dict[str, Any] | None:
    """The dict behind ``trainer.callback_metrics`` (Lightning's logger connector), ``None`` without one."""
    connector = getattr(trainer, "_logger_connector", None)
    callback = getattr(connector, "_callback_metrics", None)
    return callback if isinstance(callback, dict) else None
