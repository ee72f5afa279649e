"""A step some rank flagged: what this rank found, the diagnosis, the incident's files.

``inspector.py`` confirms this rank's own NaN/Inf, tells an AMP overflow from an incident and
returns its vote for the shared decision; ``sharded_inspector.py`` does the same in lockstep across ranks
under ``ModelParallelStrategy``. Both diagnose through the one routine of ``step_diagnosis.py``
(:func:`~.step_diagnosis.diagnose_micro_batches`) and write through ``files.py``. Each returns its
section of the event (what was found, the forensics and rows, the files), merged by
:func:`~lightning_nanguard.core.event_builder.build_event`.
"""
