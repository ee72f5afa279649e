"""The Fabric front-end: ``NanGuard`` in a hand-written Lightning Fabric loop, over the step engine.

- ``setup.py``: taking hold at ``fabric.setup`` (Fabric's ``on_after_setup``).
- ``frontend.py``: :class:`~.frontend.FabricFrontEnd`, the engine's interface read off ``Fabric``.
- ``strategy.py``: the strategy wrapper that sees ``backward``, ``clip_gradients``, the optimizer step
  and ``setup_dataloaders``; ``steps.py``: those moments carried to the engine.

Imports the engine and below; the callback (:mod:`lightning_nanguard.trainer.callback`) reaches it.
"""
