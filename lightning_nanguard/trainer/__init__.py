"""The Trainer front-end: ``NanGuard`` as a Lightning callback over the step engine.

- ``callback.py``: ``NanGuard``, the Fabric guard (:mod:`lightning_nanguard.fabric.guard`) with
  Lightning's hooks mapped onto the engine's moments of a step.
- ``frontend.py``: :class:`~.frontend.TrainerFrontEnd`, the engine's interface read off a Trainer
  (precision plugin, strategy, loggers, logger connector, ``gradient_clip_val``).
- ``strategy.py``: the strategy wrapper (the hook after ``optimizer.step``, index recording).
- ``logged_values.py``: ``self.log`` epoch aggregates kept and put back for a dropped step.
- ``checkpoint.py``: the guard's state in a checkpoint, and checkpoints kept finite.
- ``forward_only.py``: epochs without a training step (SWA's BatchNorm epoch).
- ``config.py``: Trainer settings refused at setup; ``_compat.py``: both Lightning namespaces.

May import every layer below; nothing below imports it.
"""
