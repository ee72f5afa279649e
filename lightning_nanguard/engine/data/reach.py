"""Telling the remedy book and the user what the quarantine really reaches.

A front-end registers its training loaders with :meth:`QuarantineNotices.loaders`: for each, whether
the quarantine removes its records (a batch sampler that drops them, or a stream that cuts them out
of its batches, :mod:`~lightning_nanguard.engine.data.streams`) or why it cannot. The book's
:class:`~lightning_nanguard.recover.remedies.QuarantineReach` learns it, so every quarantine message
says what is really done; a loader it cannot reach is named once in a notice, when quarantine is on.
A stream that meets a batch it cannot treat as designed reports it here (:meth:`QuarantineNotices.problem`):
one notice per kind of problem, and an index field it cannot read means the quarantine no longer
reaches that loader.

Example:
    >>> from lightning_nanguard.recover.remedies import RemedyBook
    >>> book = RemedyBook(enabled=("quarantine",))
    >>> tell = QuarantineNotices(book, None)
    >>> tell.loaders([("a", None), ("b", "it streams an IterableDataset and no index_key= is set")])
    >>> book.quarantine(items=[("a", 3), ("b", 4)])
    "quarantine: dataset indices [3] of loader 'a' will not be trained on again; dataset indices [4] of loader \
'b' will NOT be removed from training: it streams an IterableDataset and no index_key= is set"
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_nanguard.diagnose.combined import LoaderKey
from lightning_nanguard.engine.data.streams import StreamProblem
from lightning_nanguard.recover.remedies import RemedyBook
from lightning_nanguard.reporting.notices import RankNotices

__all__ = ["QuarantineNotices"]


def _where(key: LoaderKey | None) -> str:
    return "the training loader" if key is None else f"training loader {key!r}"


@dataclass
class QuarantineNotices:
    """What the quarantine reaches, told to ``book`` (its messages) and, once each, to ``notices`` (see module docs)."""

    book: RemedyBook
    notices: RankNotices | None
    unreadable: dict[LoaderKey | None, str] = field(default_factory=dict)  # stays for the run

    @property
    def wanted(self) -> bool:
        """Whether the quarantine matters in this run: the remedy is on, or a checkpoint brought a list."""
        book = self.book
        return "quarantine" in book.enabled or bool(book.quarantined) or any(book.quarantined_by_loader.values())

    def loaders(self, reach: Sequence[tuple[LoaderKey | None, str | None]]) -> None:
        """This fit's training loaders now: ``(key, None)`` for one the quarantine reaches, ``(key, why)`` otherwise.

        Replaces what was registered before; names the loaders it cannot reach in one notice (once a run).
        """
        self.book.reach.clear()
        blocked: list[str] = []
        for key, why in reach:
            if why is not None:
                self.book.reach.cannot(key, why)
                blocked.append(why if key is None else f"loader {key!r}: {why}")
            elif key in self.unreadable:  # said when it happened
                self.book.reach.cannot(key, self.unreadable[key])
            else:
                self.book.reach.acts(key)
        if blocked and self.wanted:
            self.warn(
                "quarantine-unreachable",
                "NanGuard: quarantine cannot act here: "
                + "; ".join(blocked)
                + ". Records it names at an incident will NOT be removed from training (each event says so).",
            )

    def problem(self, problem: StreamProblem) -> None:
        """A stream met a batch it could not treat as designed: say so once; an unreadable index field blocks it."""
        where = _where(problem.key)
        if problem.kind == "unreadable":
            why = f"{where} gave a batch whose index field could not be read ({problem.reason})"
            self.unreadable[problem.key] = why
            self.book.reach.cannot(problem.key, why)
            message = (
                f"NanGuard: quarantine cannot act on {where}: {problem.reason}, so the quarantined records of such "
                "batches are NOT removed from training (the batch is trained on as it is)."
            )
        elif problem.kind == "uncut":
            message = (
                f"NanGuard: quarantine could not cut the quarantined records out of a batch of {where} "
                f"({problem.reason}): the whole batch ({problem.rows} rows) was dropped, healthy rows with it. Pass "
                "NanGuard(batch_slicer=...) to keep them."
            )
        else:
            message = (
                f"NanGuard: a batch of {where} held only quarantined records: under several processes one rank "
                "alone cannot skip a batch, so it was trained on as it is (its records are NOT removed from it)."
            )
        self.warn(f"quarantine-{problem.kind}", message)

    def warn(self, key: str, message: str) -> None:
        """A notice about the quarantine, given once per ``key``."""
        if self.notices is not None:
            self.notices.warn(key, message)
