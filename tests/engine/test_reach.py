"""``engine/data/reach.py``: the remedy book and the user are told what the quarantine really reaches."""

from __future__ import annotations

import logging

import pytest

from lightning_nanguard.engine.data.reach import QuarantineNotices
from lightning_nanguard.engine.data.streams import StreamProblem
from lightning_nanguard.recover.remedies import NOT_REACHED, RemedyBook
from lightning_nanguard.reporting.notices import RankNotices

STREAM = "the training loader streams an IterableDataset and no index_key= is set"


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "lightning_nanguard"]


def test_registered_loaders_decide_what_the_book_claims(caplog: pytest.LogCaptureFixture) -> None:
    book = RemedyBook(enabled=("quarantine",))
    tell = QuarantineNotices(book, RankNotices())
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        tell.loaders([("a", None), ("b", STREAM)])
        tell.loaders([("a", None), ("b", STREAM)])  # each epoch registers again: one notice a run
    assert book.reach.why_not("a") is None and book.reach.why_not("b") == STREAM
    assert _messages(caplog) == [
        f"NanGuard: quarantine cannot act here: loader 'b': {STREAM}. Records it names at an incident will NOT be "
        "removed from training (each event says so)."
    ]
    tell.loaders([(None, None)])  # the next fit has one loader: what was registered before is gone
    assert book.reach.why_not(None) is None and book.reach.why_not("a") == NOT_REACHED


def test_no_notice_when_the_quarantine_is_off_and_empty(caplog: pytest.LogCaptureFixture) -> None:
    book = RemedyBook(enabled=())
    tell = QuarantineNotices(book, RankNotices())
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        tell.loaders([(None, STREAM)])
        assert _messages(caplog) == []
        book.quarantined.add(3)  # a checkpoint brought a quarantine list: it matters again
        tell.notices = RankNotices()
        tell.loaders([(None, STREAM)])
    assert len(_messages(caplog)) == 1


def test_an_unreadable_index_field_stops_the_claim_for_that_loader_for_the_rest_of_the_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    book = RemedyBook(enabled=("quarantine",))
    tell = QuarantineNotices(book, RankNotices())
    tell.loaders([(None, None)])
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        tell.problem(StreamProblem("unreadable", None, "the batch has no index field 'index'"))
        tell.problem(StreamProblem("unreadable", None, "the batch has no index field 'index'"))
    why = "the training loader gave a batch whose index field could not be read (the batch has no index field 'index')"
    assert book.quarantine([7]) == f"quarantine: dataset indices [7] will NOT be removed from training: {why}"
    tell.loaders([(None, None)])  # the next epoch: still not claimed
    assert book.reach.why_not(None) == why
    assert _messages(caplog) == [
        "NanGuard: quarantine cannot act on the training loader: the batch has no index field 'index', so the "
        "quarantined records of such batches are NOT removed from training (the batch is trained on as it is)."
    ]


def test_a_batch_dropped_whole_or_kept_whole_is_said_once_each(caplog: pytest.LogCaptureFixture) -> None:
    book = RemedyBook(enabled=("quarantine",))
    tell = QuarantineNotices(book, RankNotices())
    tell.loaders([("b", None)])
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        for _ in range(2):
            tell.problem(StreamProblem("uncut", "b", "the batch slicer failed (ValueError: no)", 4))
            tell.problem(StreamProblem("kept", "b", "every row of the batch holds a quarantined record", 2))
    assert book.reach.why_not("b") is None  # a batch dropped whole keeps the promise (at the cost said)
    assert _messages(caplog) == [
        "NanGuard: quarantine could not cut the quarantined records out of a batch of training loader 'b' (the batch "
        "slicer failed (ValueError: no)): the whole batch (4 rows) was dropped, healthy rows with it. Pass "
        "NanGuard(batch_slicer=...) to keep them.",
        "NanGuard: a batch of training loader 'b' held only quarantined records: under several processes one rank "
        "alone cannot skip a batch, so it was trained on as it is (its records are NOT removed from it).",
    ]
