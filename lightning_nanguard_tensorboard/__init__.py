"""The NanGuard tab of TensorBoard: a TensorBoard plugin found through the ``tensorboard_plugins`` entry point.

Installing ``lightning-nanguard`` is all it takes: ``tensorboard --logdir LOGDIR`` shows a
**NanGuard** tab on any log directory with a run guarded by ``NanGuard``. The plugin reads
``<run>/nanguard/`` (``events.jsonl``, the incident context files, the repro bundles' names) and the
run's TensorBoard scalars; it needs neither torch nor Lightning.

This module is what TensorBoard imports at start-up. It imports only TensorBoard's plugin base
classes; the plugin itself is imported when TensorBoard loads it, and any failure there is logged
and disables the tab, never TensorBoard.

Example:
    >>> from tensorboard.plugins import base_plugin
    >>> issubclass(NanGuardLoader, base_plugin.TBLoader)
    True
"""

from __future__ import annotations

import logging
from typing import Any

from tensorboard.plugins import base_plugin

__all__ = ["PLUGIN_NAME", "NanGuardLoader"]

PLUGIN_NAME = "nanguard"

logger = logging.getLogger(__name__)


class NanGuardLoader(base_plugin.TBLoader):
    """Loads :class:`~lightning_nanguard_tensorboard.plugin.NanGuardPlugin`; on any error, no tab."""

    def load(self, context: Any) -> Any:
        try:
            from lightning_nanguard_tensorboard.plugin import NanGuardPlugin

            return NanGuardPlugin(context)
        except Exception:  # a broken plugin must never stop TensorBoard
            logger.warning("NanGuard: the TensorBoard tab is disabled, its plugin failed to load", exc_info=True)
            return None
