"""Small device flags read to the host, one read per device (``lightning_nanguard.core.host``)."""

from __future__ import annotations

import pytest
import torch
from host_reads import HostReadCounter

from lightning_nanguard.core.host import all_true, read_flags


def test_read_flags_keeps_the_order_given() -> None:
    pattern = [True, False, False, True, True, False, True]
    assert read_flags([torch.tensor(value) for value in pattern]) == pattern


def test_numeric_and_one_element_flags() -> None:
    flags = [torch.tensor(0.0), torch.tensor(2.5), torch.tensor([1]), torch.tensor(-1, dtype=torch.int64)]
    assert read_flags(flags) == [False, True, True, True]


def test_mixed_dtypes_are_read_together() -> None:
    flags = [torch.tensor(True), torch.tensor(0, dtype=torch.uint8), torch.tensor(3.0, dtype=torch.float16)]
    assert read_flags(flags) == [True, False, True]


def test_no_flags() -> None:
    assert read_flags([]) == []
    assert all_true([]) is True


@pytest.mark.parametrize("count", [1, 5, 200])
def test_one_host_read_per_device(count: int) -> None:
    flags = [torch.tensor(i % 3 == 0) for i in range(count)]
    with HostReadCounter() as counter:
        values = read_flags(flags)
    assert values == [i % 3 == 0 for i in range(count)]
    assert sum(counter.reads.values()) == 1 and counter.reads["tolist"] == 1


def test_nothing_to_read_makes_no_read() -> None:
    with HostReadCounter() as counter:
        read_flags([])
    assert sum(counter.reads.values()) == 0


@pytest.mark.parametrize(("values", "expected"), [([True, True], True), ([True, False], False), ([False], False)])
def test_all_true(values: list[bool], expected: bool) -> None:
    with HostReadCounter() as counter:
        assert all_true([torch.tensor(value) for value in values]) is expected
    assert sum(counter.reads.values()) == 1


class Elsewhere(torch.Tensor):
    """A CPU tensor that says it lives on another device: read_flags groups flags by ``.device``."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 7)


def test_flags_of_two_devices_are_read_once_per_device_in_the_order_given() -> None:
    """Without a GPU: flags that report another device form a group of their own."""
    pattern = [True, False, False, True, True, False]
    flags = [torch.tensor(v) if i % 2 else torch.tensor(v).as_subclass(Elsewhere) for i, v in enumerate(pattern)]
    assert {str(flag.device) for flag in flags} == {"cpu", "cuda:7"}
    with HostReadCounter() as counter:
        values = read_flags(flags)
    assert values == pattern  # not grouped by device: [T, F, T, F, T, F]
    assert counter.reads["tolist"] == 2 and sum(counter.reads.values()) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_devices_are_read_once_each_and_keep_their_order() -> None:
    """An op can mix a CUDA tensor with a CPU scalar tensor: its flags live on both devices."""
    devices = ["cuda", "cpu", "cuda", "cpu", "cpu", "cuda"]
    pattern = [True, False, False, True, True, False]
    flags = [torch.tensor(value, device=device) for value, device in zip(pattern, devices, strict=True)]
    with HostReadCounter() as counter:
        values = read_flags(flags)
    assert values == pattern
    assert counter.reads["tolist"] == 2 and sum(counter.reads.values()) == 2
    assert all_true([torch.tensor(True, device="cuda"), torch.tensor(True)]) is True
    assert all_true([torch.tensor(True, device="cuda"), torch.tensor(False)]) is False
