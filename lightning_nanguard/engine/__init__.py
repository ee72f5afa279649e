"""The step engine: one optimizer step under the guard, for any training loop. Imports no Lightning.

A front-end (:mod:`lightning_nanguard.fabric` for Fabric loops, :mod:`lightning_nanguard.trainer`
for the Trainer) hands it a
:class:`~lightning_nanguard.engine.frontend.FrontEnd` and calls it at the moments of a step; the
engine checks, agrees across ranks, decides, acts, diagnoses and records, with the stages below
(``detect`` ... ``reporting``). Its sub-stages, in the order a bad step meets them:

- ``moments.py``: :class:`~.moments.GuardEngine`, the parts composed and the moments a front-end
  calls (configure, open logs, start, epoch, batch, loss, begin update, step, after step, end, state).
- ``frontend.py``: the interface a loop provides (the model, the optimizer step, re-running a step,
  where to log) and :class:`~.frontend.StepView`.
- ``step/``: the step in progress: its window (micro-batches, losses, BatchNorm state), the fused
  check's flags (``check.py``), the tensors each optimizer updates (``params.py``), the loss-spike
  watch, sync-free skipping, per-optimizer counts (``optimizers.py``), closure steps undone
  (``closure_undo.py``).
- ``controller.py``: check, agree, decide; ``step_actions.py``: what becomes of a checked step (drop,
  remedies, the event, raising, the guard off); ``precursor_part.py``: the precursor watch and
  QK-clip; ``after_step.py``: rollback, weight check, snapshot.
- ``incident/``: a bad step: what this rank found (``inspector.py``; ``sharded_inspector.py`` in lockstep
  under sharding), the one diagnosis routine (``step_diagnosis.py``), the incident's files.
- ``rows/``: which samples and records the offending rows are (``samples.py``, ``record_names.py``).
- ``data/``: the dataset indices of each batch and reading a record again (loader level, no Trainer).
- ``recording.py``: events, sinks and scalars through the front-end; ``settings.py``: the
  ``NanGuard`` arguments validated and turned into each part's settings; ``state.py``,
  ``failure.py``, ``parts.py``, ``shard_layout.py``: shared state, the failsafe, the core and its
  optional parts, the sharded layout.
"""
