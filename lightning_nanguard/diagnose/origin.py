"""Localise the origin of a diagnosed batch: one instrumented pass of the *full* batch, as training ran it.

:func:`localized` follows the rows of the offending samples when they are known (so the op named is
one that happens for them in the real batch), falls back to the whole batch when nothing shows in
those rows, and never raises: a failure keeps the rest of the diagnosis.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_nanguard.diagnose.isolation import isolated
from lightning_nanguard.diagnose.localization import Localization, localize
from lightning_nanguard.diagnose.runner import SubBatchRunner, loss_from_output

__all__ = ["localized", "spike_localizes"]

log = logging.getLogger("lightning_nanguard")


def spike_localizes(runner: SubBatchRunner, saw_nonfinite: bool) -> bool:
    """In loss-spike mode the origin of a merely large loss is not localised, only that of a NaN/Inf."""
    return runner.loss_threshold is None or saw_nonfinite


def localized(
    runner: SubBatchRunner, rows: list[int] | None, wanted: bool, source_root: str | None, scan_input: bool = False
) -> tuple[Localization | None, str | None]:
    """Localise on the full batch (following ``rows``); a failure keeps the rest of the diagnosis.

    ``scan_input``: report a batch holding NaN/Inf as the origin (when no ``"input"`` cause was decided).
    """
    if not wanted:
        return None, None
    try:
        found = runner.instrumented(lambda: _localize_batch(runner, rows, source_root, scan_input))
        if rows is not None and not runner.found(found):  # nothing in those rows: the whole batch
            found = runner.instrumented(lambda: _localize_batch(runner, None, source_root, scan_input))
        return found, None
    except Exception as error:  # keep the samples found: only the origin is unknown
        log.warning("NanGuard: localising the origin failed: %r", error, exc_info=True)
        return None, f"localisation failed: {error!r}"


def _localize_batch(
    runner: SubBatchRunner, rows: list[int] | None, source_root: str | None, scan_input: bool
) -> Localization:
    """One instrumented forward/backward of the full batch, isolated, as training ran it."""
    fields: list[Any] | None = None if scan_input else []
    if scan_input and runner.combined is not None:  # each loader's part has its own size
        fields = list(runner.nonfinite_fields())
    with isolated(runner.module), runner.mode(False):
        return localize(
            runner.module,
            lambda: loss_from_output(runner.step_fn(runner.batch, runner.batch_idx)),
            batch=runner.batch,
            params=runner.params,
            rows=runner.rows(rows),
            batch_size=runner.size,
            source_root=source_root,
            input_fields=fields,
            grads_from_graph=runner.grads_from_graph,
        )
