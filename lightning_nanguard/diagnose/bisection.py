"""Adaptive group testing: find which samples of a batch make a step non-finite.

The algorithm only needs a predicate ``is_bad(positions) -> bool`` that runs one forward/backward
pass on the sub-batch ``positions``. It assumes badness is carried by individual samples (a
sub-batch is bad iff it contains an offending sample) and checks that assumption as it goes: if
a bad group holds no sample that is bad on its own, the samples only fail together (batch
interaction) and the result says so instead of guessing.

For ``k`` offending samples among ``n`` it uses at most ``2 * k * log2(n) + 2`` passes (checked
exhaustively for n <= 64 and small k, and on random sets up to n = 256): one to confirm the whole
batch, then binary splitting where a bad group's second half is tested only when the first half
was bad too (otherwise the second half must hold the bad sample: it is split without a test, and
the single sample it narrows down to is tested to confirm). Worst cases measured: n=8, k=1: 7 passes;
n=32, k=1: 11; n=32, k=2: 19; n=64, k=4: 38 (bounds 8, 12, 22, 50).

Example:
    >>> bad = {3, 12}
    >>> result = find_offending(16, lambda positions: bool(bad & set(positions)))
    >>> result.offending, result.passes
    ([3, 12], 13)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["NOT_REPRODUCED", "BisectionResult", "find_offending"]

NOT_REPRODUCED = (
    "re-running the batch on the same weights gave finite values (non-deterministic ops, or the "
    "values depend on state the re-run does not reproduce)"
)
"""Why a batch is not attributable when its re-run (unscaled, on the same weights) is finite."""

Predicate = Callable[[Sequence[int]], bool]


_INTERACTION = "no single sample is non-finite on its own: the samples only fail together (batch interaction)"


class _PassBudgetExhausted(Exception):
    pass


@dataclass(frozen=True)
class BisectionResult:
    """Outcome of :func:`find_offending`.

    Attributes:
        offending: sorted positions of offending samples, or ``None`` when not attributable.
        passes: forward/backward passes used (calls of the predicate).
        reason: why the result is not attributable (empty when it is).
        smallest_bad: the smallest bad group seen (for localisation), possibly the whole batch.
        complete: False when ``max_passes`` stopped the search early (``offending`` is then partial).
        interacting: bad groups holding no sample that is bad on its own (they fail only together).
        reproduced: False when the whole batch re-ran finite (see :data:`NOT_REPRODUCED`).
    """

    offending: list[int] | None
    passes: int
    reason: str = ""
    smallest_bad: list[int] = field(default_factory=list)
    complete: bool = True
    interacting: list[list[int]] = field(default_factory=list)
    reproduced: bool = True


def find_offending(
    n: int,
    is_bad: Predicate,
    max_passes: int = 128,
    confirm_whole: bool = True,
    known: Mapping[tuple[int, ...], bool] | None = None,
    spent: int = 0,
) -> BisectionResult:
    """Find the positions in ``range(n)`` that make ``is_bad`` true, by adaptive splitting.

    Args:
        n: batch size.
        is_bad: predicate over a list of positions; one call = one forward/backward pass.
        max_passes: stop after this many calls and report what was found so far.
        confirm_whole: first check that the whole batch is bad (it may not be: the bad values can
            come from the weights' history, or from randomness the re-run does not reproduce).
        known: results of groups already run (e.g. the whole batch and single samples, by an
            earlier check): reused without a pass. A group holding a single sample known to be bad
            is bad too.
        spent: passes already used by that earlier check; they count towards ``max_passes``
            (``passes`` in the result counts this search's own).

    Example:
        >>> find_offending(4, lambda positions: len(positions) == 4).reason
        'no single sample is non-finite on its own: the samples only fail together (batch interaction)'
        >>> find_offending(8, lambda positions: 5 in positions, known={tuple(range(8)): True, (5,): True}).passes
        3
    """
    passes = 0
    smallest_bad: list[int] = list(range(n))
    results = dict(known or {})
    bad_singles = {group[0] for group, bad in results.items() if bad and len(group) == 1}

    def test(positions: list[int]) -> bool:
        nonlocal passes, smallest_bad
        key = tuple(positions)
        if key in results:
            bad = results[key]
        elif bad_singles.intersection(positions):
            bad = True
        else:
            if spent + passes >= max_passes:
                raise _PassBudgetExhausted
            passes += 1
            bad = is_bad(positions)
        if bad and len(positions) < len(smallest_bad):
            smallest_bad = list(positions)
        return bad

    whole = list(range(n))
    if n == 0:
        return BisectionResult(None, 0, "the batch is empty", [])
    try:
        if confirm_whole and not test(whole):
            return BisectionResult(None, passes, NOT_REPRODUCED, [], reproduced=False)
    except _PassBudgetExhausted:
        return BisectionResult(None, passes, f"max_bisect_passes={max_passes} reached", whole, complete=False)

    offending: list[int] = []
    interacting: list[list[int]] = []

    def search(group: list[int], confirmed: bool) -> bool:
        """Find the offending samples of ``group``, which is bad: tested (``confirmed``) or inferred.

        A group is inferred bad when it is the second half of a bad group whose first half tested
        good; it is not tested itself (that saves one pass per level). If an inferred group holds
        no offending sample after all, returns False: the nearest confirmed ancestor is then a
        group whose samples only fail together.
        """
        if len(group) == 1:
            if confirmed or test(group):
                offending.append(group[0])
                return True
            return False
        half = len(group) // 2
        left, right = group[:half], group[half:]
        if test(left):
            search(left, True)
            if test(right):
                search(right, True)
            return True
        if search(right, False):
            return True
        if confirmed:
            interacting.append(group)
        return False

    complete = True
    try:
        search(whole, confirm_whole)
    except _PassBudgetExhausted:
        complete = False
    if not offending:
        if interacting:
            reason = _INTERACTION
        elif complete:
            reason = "no sub-batch was non-finite (the whole batch was not re-run: confirm_whole=False)"
        else:
            reason = f"max_bisect_passes={max_passes} reached before a single sample was isolated"
        return BisectionResult(None, passes, reason, smallest_bad, complete, interacting)
    notes = []
    if interacting:
        notes.append(f"some groups only fail together: {interacting}")
    if not complete:
        notes.append(f"max_bisect_passes={max_passes} reached: more samples may be offending")
    reason = "; ".join(notes)
    return BisectionResult(sorted(offending), passes, reason, smallest_bad, complete, interacting)
