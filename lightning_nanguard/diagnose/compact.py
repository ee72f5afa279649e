"""Bounded per-channel details for events: the first few, counts, and how many more.

A NaN image in a ResNet makes every channel of every BatchNorm layer non-finite: listed in full,
that is hundreds of lines per panel and tens of kilobytes per ``events.jsonl`` line. Events carry
the first :data:`MAX_LAYERS` layers with their first :data:`MAX_CHANNELS` channels, and, when
that cuts anything, a summary with the totals and the count per layer shown; the full lists go to
the repro bundle (``details_full.json``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_CHANNELS", "MAX_LAYERS", "channels_text", "compact_channels"]

MAX_LAYERS = 4
MAX_CHANNELS = 8


def compact_channels(
    channels: Mapping[str, Sequence[int]], max_layers: int = MAX_LAYERS, max_channels: int = MAX_CHANNELS
) -> tuple[dict[str, list[int]], dict[str, Any] | None]:
    """The first layers and channels of ``channels`` and, when something was cut, a summary.

    Example:
        >>> shown, summary = compact_channels({f"bn{i}": list(range(64)) for i in range(20)})
        >>> list(shown), shown["bn0"]
        (['bn0', 'bn1', 'bn2', 'bn3'], [0, 1, 2, 3, 4, 5, 6, 7])
        >>> summary
        {'layers': 20, 'channels': 1280, 'counts': {'bn0': 64, 'bn1': 64, 'bn2': 64, 'bn3': 64}}
        >>> compact_channels({"net.1": [0, 2]})
        ({'net.1': [0, 2]}, None)
    """
    items = list(channels.items())
    shown = {name: [int(c) for c in list(found)[:max_channels]] for name, found in items[:max_layers]}
    if len(items) <= max_layers and all(len(found) <= max_channels for _, found in items):
        return shown, None
    summary = {
        "layers": len(items),
        "channels": sum(len(found) for _, found in items),
        "counts": {name: len(found) for name, found in items[:max_layers]},
    }
    return shown, summary


def channels_text(shown: Mapping[str, Sequence[int]], summary: Mapping[str, Any] | None = None) -> str:
    """One bounded line for a panel: each layer shown with its first channels, then what was left out.

    Example:
        >>> shown, summary = compact_channels({f"bn{i}": list(range(64)) for i in range(20)})
        >>> channels_text(shown, summary)  # doctest: +NORMALIZE_WHITESPACE
        'bn0 [0, 1, 2, 3, 4, 5, 6, 7, ...] (64 channels); bn1 [0, 1, 2, 3, 4, 5, 6, 7, ...] (64 channels);
        bn2 [0, 1, 2, 3, 4, 5, 6, 7, ...] (64 channels); bn3 [0, 1, 2, 3, 4, 5, 6, 7, ...] (64 channels);
        and 16 more layers (1280 channels in 20 layers)'
        >>> channels_text({"net.1": [0, 2]})
        'net.1 [0, 2]'
    """
    counts: Mapping[str, Any] = (summary or {}).get("counts", {})
    parts = []
    for name, found in shown.items():
        count = int(counts.get(name, len(found)))
        listed = ", ".join(str(c) for c in found) + (", ..." if count > len(found) else "")
        parts.append(f"{name} [{listed}]" + (f" ({count} channels)" if count > len(found) else ""))
    if summary is not None and int(summary.get("layers", 0)) > len(shown):
        more = int(summary["layers"]) - len(shown)
        parts.append(f"and {more} more layers ({summary.get('channels')} channels in {summary['layers']} layers)")
    return "; ".join(parts)
