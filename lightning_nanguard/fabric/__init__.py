"""The Fabric front-end: ``FabricGuard`` in a hand-written Lightning Fabric loop, over the step engine.

- ``guard.py``: :class:`~.guard.FabricGuard`, the arguments, the state and Fabric's two hooks (no
  Lightning import: Fabric calls a callback's hooks by name); the Trainer callback builds on it.
- ``setup.py``: taking hold at ``fabric.setup`` (Fabric's ``on_after_setup``); ``fabric_class.py``:
  ``setup_module`` and loaders set up before the model, once a Fabric loop with a guard is in use.
- ``frontend.py``: :class:`~.frontend.FabricFrontEnd`, the engine's interface read off ``Fabric``.
- ``strategy.py``: the strategy wrapper that sees ``backward``, ``clip_gradients``, the optimizer step
  and ``setup_dataloaders``; ``steps.py``: those moments carried to the engine.
- ``quarantine.py``, ``litgpt_loops.py``: the quarantine of its loaders, LitGPT's recipe losses.

Imports the engine and below.
"""
