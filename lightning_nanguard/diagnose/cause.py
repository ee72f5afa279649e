"""The cause of a bad step, decided before any bisection: the batch itself, or the model state.

Two causes are decided before the search for offending samples, because when they hold no sample is
to blame for the model, or the samples are found without running the model:

- ``"input"`` (:func:`check_input`): the batch itself holds NaN/Inf. The samples are read off the
  batch (no pass); when only some samples hold it, one pass over the others confirms that they
  are healthy (otherwise there is a second fault, and the search goes on as usual).
- ``"state"`` (:func:`check_state`): the weights (or the optimizer state that produced them) are at
  fault: a known-good reference sub-batch kept from a recent healthy step fails with the current
  weights (1 pass), or, without a reference, the whole batch re-runs bad and each of
  :data:`PROBES` single samples spread over the batch fails on its own (at most
  :data:`MAX_STATE_PASSES` passes; with several training loaders, each probe is one sample of
  every loader, since no loader's part may be empty). One or two bad samples can never pass this test: three
  distinct samples must each fail alone. Any probe that runs finite ends the check at once: that
  sample is healthy, so the weights are not at fault, and the search goes on with the results
  already known.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_nanguard.diagnose.batching import BatchField
from lightning_nanguard.diagnose.runner import SubBatchRunner

__all__ = [
    "MAX_STATE_PASSES",
    "PROBES",
    "InputCheck",
    "StateCheck",
    "check_input",
    "check_state",
    "describe_fields",
    "probe_positions",
]

log = logging.getLogger("lightning_nanguard")

PROBES = 3
MAX_STATE_PASSES = 1 + PROBES  # the whole batch, then the probes


@dataclass(frozen=True)
class InputCheck:
    """Where the batch itself holds NaN/Inf.

    Attributes:
        fields: batch fields holding NaN/Inf, in batch order.
        samples: positions of the samples holding it (sorted).
        shared_fields: fields whose NaN/Inf is outside the sample dimension (no sample to blame).
        confirmed: True when the NaN/Inf in the batch explains the step: every other sample runs
            finite (or there is no other sample).
        passes: passes spent (0 or 1).
    """

    fields: tuple[BatchField, ...] = ()
    samples: tuple[int, ...] = ()
    shared_fields: tuple[BatchField, ...] = ()
    confirmed: bool = False
    passes: int = 0


def check_input(runner: SubBatchRunner, reference_batch: Any = None, max_passes: int = 1) -> InputCheck:
    """Read the NaN/Inf of the batch itself, per field and sample; confirm with the other samples.

    A field that also holds NaN/Inf in ``reference_batch`` (a sub-batch of a recent healthy step)
    is deliberate (e.g. a ``-inf`` mask built in ``collate``) and is ignored.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def training_step(self, x, batch_idx):
        ...         return x.sum()
        >>> x = torch.ones(4, 2)
        >>> x[1, 0] = float("nan")
        >>> found = check_input(SubBatchRunner(Net(), x))
        >>> found.fields, found.samples, found.confirmed, found.passes
        (('<batch>',), (1,), True, 1)
    """
    fields = runner.nonfinite_fields()
    if fields and reference_batch is not None:
        try:
            deliberate = set(runner.nonfinite_fields(reference_batch))
        except TypeError:
            deliberate = set()
        fields = {name: samples for name, samples in fields.items() if name not in deliberate}
    if not fields:
        return InputCheck()
    samples = sorted({p for positions in fields.values() if positions for p in positions})
    shared = tuple(name for name, positions in fields.items() if positions is None)
    if shared or not samples:  # NaN/Inf that no sample carries: the batch is at fault, no sample is
        return InputCheck(tuple(fields), tuple(samples), shared, confirmed=True)
    others = [p for p in range(runner.size) if p not in samples]
    if not others or _empties_a_loader(runner, samples):  # no healthy sample (of some loader) to run the others with
        return InputCheck(tuple(fields), tuple(samples), (), confirmed=True)
    if max_passes < 1:
        return InputCheck(tuple(fields), tuple(samples), ())
    healthy = not runner.is_bad(others)
    return InputCheck(tuple(fields), tuple(samples), (), confirmed=healthy, passes=1)


def _probe_groups(runner: SubBatchRunner) -> list[list[int]]:
    """Single samples spread over the batch; with several training loaders, one sample of every loader."""
    combined = getattr(runner, "combined", None)
    if combined is None:
        return [[p] for p in probe_positions(runner.size)]
    rows: list[list[int]] = combined.rows(PROBES)
    return rows


def _empties_a_loader(runner: SubBatchRunner, samples: Sequence[int]) -> bool:
    """With several training loaders: whether ``samples`` are every sample of some loader's part."""
    combined = getattr(runner, "combined", None)
    if combined is None:
        return False
    return any(len(group) == size for group, size in zip(combined.group(samples), combined.sizes, strict=True))


def probe_positions(n: int) -> list[int]:
    """The single samples probed for the ``"state"`` cause: the middles of the batch's three thirds.

    Spread out, so that a run of consecutive bad samples (an unshuffled corrupt shard) or every
    other sample cannot cover them all unless it covers most of the batch.

    Example:
        >>> probe_positions(8), probe_positions(32), probe_positions(3), probe_positions(2)
        ([1, 4, 6], [5, 16, 26], [0, 1, 2], [])
    """
    if n < PROBES:
        return []
    return sorted({(2 * i + 1) * n // (2 * PROBES) for i in range(PROBES)})


@dataclass(frozen=True)
class StateCheck:
    """Outcome of :func:`check_state`.

    Attributes:
        state: the model state is at fault (no sample is to blame).
        passes: forward/backward passes spent.
        reason: why (the evidence), when ``state``.
        reproduced: whether the whole batch re-ran bad (``None``: not run).
        known: results of the groups run, keyed by their positions (for the search that follows).
        probes: the single samples run, in order.
    """

    state: bool
    passes: int = 0
    reason: str = ""
    reproduced: bool | None = None
    known: dict[tuple[int, ...], bool] = field(default_factory=dict)
    probes: tuple[int, ...] = ()


def _reference_fails(reference: SubBatchRunner) -> bool | None:
    try:
        return reference.is_bad(list(range(reference.size)))
    except Exception as error:  # a user step that refuses the reference: decide without it
        log.warning("NanGuard: re-running the reference sub-batch failed, deciding without it: %r", error)
        return None


def check_state(
    runner: SubBatchRunner,
    reference: SubBatchRunner | None = None,
    max_passes: int = MAX_STATE_PASSES,
    what: str = "non-finite",
) -> StateCheck:
    """Decide whether the current model state (not the data) makes the batch bad.

    Args:
        runner: runs sub-batches of the bad batch.
        reference: runs a known-good reference sub-batch of a recent healthy step, if kept.
        max_passes: pass budget (the state check never uses more than :data:`MAX_STATE_PASSES`).
        what: what "bad" means, for the reason (``"non-finite"``, or ``"non-finite or above the
            loss threshold"``).

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def __init__(self, scale):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.tensor(scale))
        ...     def training_step(self, x, batch_idx):
        ...         return (self.w * x).exp().mean()
        >>> x = torch.arange(10.0)
        >>> check_state(SubBatchRunner(Net(1e30), x)).state
        True
        >>> healthy = check_state(SubBatchRunner(Net(10.0), x))  # exp(90) overflows: sample 9 only
        >>> healthy.state, healthy.passes, healthy.known[(1,)]
        (False, 2, False)
    """
    budget = min(max_passes, MAX_STATE_PASSES)
    if reference is not None and budget >= 1:
        fails = _reference_fails(reference)
        if fails is not None:
            passes = reference.passes
            if fails:
                reason = (
                    f"a known-good reference sub-batch ({reference.size} samples of a recent healthy step) is "
                    f"{what} too with the current weights: the model state diverged, not the data"
                )
                return StateCheck(True, passes, reason)
            return StateCheck(False, passes)
    if budget < 1:
        return StateCheck(False)
    whole = list(range(runner.size))
    start = runner.passes
    known: dict[tuple[int, ...], bool] = {}
    reproduced = runner.is_bad(whole)
    known[tuple(whole)] = reproduced
    if not reproduced or runner.known_good:  # known-good samples (a bundle's reference): not the state
        return StateCheck(False, runner.passes - start, reproduced=reproduced, known=known)
    probes: list[tuple[int, ...]] = []
    for group in _probe_groups(runner):
        if runner.passes - start >= budget:
            break
        probes.append(tuple(group))
        known[tuple(group)] = runner.is_bad(group)
        if not known[tuple(group)]:
            break
    state = len(probes) == PROBES and all(known[group] for group in probes)
    reason = ""
    combined = getattr(runner, "combined", None)
    if state and combined is None:
        reason = (
            f"every sample tried is {what} on its own (positions {[g[0] for g in probes]} of {runner.size}): the "
            "model state (weights, optimizer) is at fault, not the data"
        )
    elif state and combined is not None:
        reason = (
            f"every combination of one sample per training loader tried is {what} (positions "
            f"{[list(g) for g in probes]} of {runner.size}, numbered over the loaders {list(combined.keys)}): "
            "the model state (weights, optimizer) is at fault, not the data"
        )
    singles = tuple(p for group in probes for p in group)
    return StateCheck(state, runner.passes - start, reason, True, known, singles)


def describe_fields(fields: Sequence[BatchField]) -> str:
    """``"x"``, ``"x, y"``, ``"[0]"``: batch fields as shown in reasons.

    Example:
        >>> describe_fields(["pixel_values", 0])
        'pixel_values, [0]'
    """
    return ", ".join(f"[{name}]" if isinstance(name, int) else str(name) for name in fields)
