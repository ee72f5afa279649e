"""Warnings given once per run, prefixed with the rank under DDP (``lightning_nanguard.reporting.notices``)."""

from __future__ import annotations

import logging

import pytest

from lightning_nanguard.reporting.notices import RankNotices, log


def _messages(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int, str]]:
    return [(r.name, r.levelno, r.getMessage()) for r in caplog.records]


def test_each_key_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    notices = RankNotices()
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        assert notices.warn("syncbn", "first")
        assert not notices.warn("syncbn", "again")
        assert notices.warn("diagnosis", "other")
    assert _messages(caplog) == [
        ("lightning_nanguard", logging.WARNING, "first"),
        ("lightning_nanguard", logging.WARNING, "other"),
    ]


def test_the_rank_prefixes_the_message_under_ddp_only(caplog: pytest.LogCaptureFixture) -> None:
    notices = RankNotices()
    notices.rank = 3
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        notices.warn("a", "one process")
        notices.world_size = 4
        notices.warn("b", "several")
    assert [message for _, _, message in _messages(caplog)] == ["one process", "[rank: 3] several"]


def test_reset_forgets_what_was_said(caplog: pytest.LogCaptureFixture) -> None:
    notices = RankNotices()
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        notices.warn("k", "said")
        notices.reset()
        assert notices.warn("k", "said")
    assert len(caplog.records) == 2


def test_two_notices_do_not_share_what_they_said() -> None:
    first, second = RankNotices(), RankNotices()
    first.warn("k", "x")
    assert second.warn("k", "x")


def test_the_logger_is_the_packages() -> None:
    assert log.name == "lightning_nanguard"
