"""Records and pipelines for the tests of the record check: padded token records, collates that reorder, drop, pack.

The ground truth of every test comes from what the records carry (their tokens say which record they
are), never from the guard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

# record i: a sequence of (i % 4) + 2 tokens, each token 10 * i + position, and a name
RECORDS = {i: torch.arange(10 * i, 10 * i + (i % 4) + 2) for i in range(20, 28)}


def collate(items: Sequence[Tensor], left: bool = False) -> dict[str, Any]:
    """Pad to the longest sequence (right, or ``left``), with a mask and the record's name."""
    width = max(len(t) for t in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.bool)
    for row, t in enumerate(items):
        where = slice(width - len(t), width) if left else slice(0, len(t))
        ids[row, where], mask[row, where] = t, True
    return {"ids": ids, "mask": mask, "name": [f"r{int(t[0]) // 10}" for t in items]}


def reader(left: bool = False, counter: list[int] | None = None) -> Callable[[int], Any]:
    def read(index: int) -> Any:
        if counter is not None:
            counter.append(index)
        return collate([RECORDS[index]], left=left)

    return read
