"""A step some rank flagged: what this rank found, the diagnosis, the incident's files.

``inspector.py`` confirms this rank's own NaN/Inf, tells an AMP overflow from an incident and
returns its vote for the shared decision; ``sharded_inspector.py`` does the same in lockstep across ranks
under ``ModelParallelStrategy``. Both diagnose through the one routine of ``step_diagnosis.py``
(:func:`~.diagnosis.diagnose_micro_batches`) and write through ``files.py``.
"""
