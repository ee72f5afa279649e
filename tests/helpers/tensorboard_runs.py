"""The event files of a TensorBoard run, read back with ``EventAccumulator`` (nothing sampled away)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

__all__ = ["CUSTOM_SCALARS_TAG", "TensorBoardRun", "read_tensorboard"]

CUSTOM_SCALARS_TAG = "custom_scalars__config__"


class TensorBoardRun:
    """The event files of one TensorBoard run, read back with ``EventAccumulator`` (nothing sampled away)."""

    def __init__(self, logdir: str | Path) -> None:
        self.accumulator = EventAccumulator(
            str(logdir),
            size_guidance={"scalars": 0, "tensors": 0, "histograms": 0, "images": 0, "audio": 0},
        )
        self.accumulator.Reload()

    @property
    def tags(self) -> dict[str, Any]:
        return self.accumulator.Tags()

    def scalars(self, tag: str) -> list[tuple[int, float]]:
        """``(step, value)`` pairs of a scalar tag."""
        return [(event.step, event.value) for event in self.accumulator.Scalars(tag)]

    def texts(self, tag: str) -> list[tuple[int, str]]:
        """``(step, text)`` pairs of a text summary (``add_text`` stores it under ``<tag>/text_summary``)."""
        return [
            (event.step, b"".join(event.tensor_proto.string_val).decode("utf-8"))
            for event in self.accumulator.Tensors(tag)
        ]

    def layouts(self) -> list[layout_pb2.Layout]:
        """Every custom-scalars layout written to the run (``add_custom_scalars``)."""
        if CUSTOM_SCALARS_TAG not in self.tags["tensors"]:
            return []
        out = []
        for event in self.accumulator.Tensors(CUSTOM_SCALARS_TAG):
            layout = layout_pb2.Layout()
            layout.ParseFromString(event.tensor_proto.string_val[0])
            out.append(layout)
        return out


def read_tensorboard(logdir: str | Path) -> TensorBoardRun:
    return TensorBoardRun(logdir)
