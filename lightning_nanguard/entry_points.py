"""The guard switched on from the environment, for Fabric loops that build ``Fabric()`` themselves (LitGPT).

Lightning Fabric adds to every ``Fabric()`` the callbacks that installed packages return from the
entry-point group ``lightning.fabric.callbacks_factory``. This package registers
:func:`nanguard_from_environment` there: with ``NANGUARD=1`` it returns one ``NanGuard()`` (its
arguments from ``NANGUARD_ARGS``, a JSON object validated like the constructor's), otherwise
nothing. A guard made so stands aside when the user passes a ``NanGuard`` of their own. With
``NANGUARD`` unset this imports nothing beyond the package itself: no Lightning namespace, no guard;
when the process has made a guard already (``Fabric(callbacks=[NanGuard()])``), it holds the
``Fabric`` class for it (:mod:`lightning_nanguard.fabric.fabric_class`: ``setup_module`` and
loaders set up before the model reach the guard), and only then.

Example:
    >>> import os
    >>> os.environ.pop("NANGUARD", None) and None
    >>> nanguard_from_environment()
    []
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["NANGUARD", "NANGUARD_ARGS", "nanguard_from_environment"]

NANGUARD = "NANGUARD"  # "1" (or "true", "yes", "on"): add a guard to every Fabric()
NANGUARD_ARGS = "NANGUARD_ARGS"  # a JSON object of NanGuard arguments, e.g. {"action": "rollback"}
_ON = {"1", "true", "yes", "on"}


def nanguard_from_environment() -> list[Any]:
    """``[NanGuard(**$NANGUARD_ARGS)]`` when ``$NANGUARD`` is on, else ``[]``.

    Raises:
        ValueError: ``NANGUARD_ARGS`` is not a JSON object, or names an argument or value
            ``NanGuard`` refuses (the constructor's own message, prefixed with the variable's name).
    """
    guard_module = sys.modules.get("lightning_nanguard.fabric.fabric_class")  # loaded once a guard was made
    if guard_module is not None:
        guard_module.hold_fabric_class_for_guards()
    if os.environ.get(NANGUARD, "").strip().lower() not in _ON:
        return []
    text = os.environ.get(NANGUARD_ARGS, "").strip()
    try:
        arguments = json.loads(text) if text else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"{NANGUARD_ARGS} must be a JSON object of NanGuard arguments: {error}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{NANGUARD_ARGS} must be a JSON object of NanGuard arguments, got {text!r}")
    from lightning_nanguard.fabric.fabric_class import hold_fabric_class_for_guards
    from lightning_nanguard.trainer.callback import NanGuard  # only now: Fabric() loads this module every time

    try:
        guard = NanGuard(**arguments)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{NANGUARD_ARGS}: {error}") from None
    guard.from_environment = True
    hold_fabric_class_for_guards()  # this Fabric() is under construction: its loop will be held
    return [guard]
