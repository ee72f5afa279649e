"""Diagnose: why a step went bad. The cause, the offending samples, the module, op and source line.

Trainer-free: :func:`~lightning_nanguard.diagnose.batch_diagnosis.diagnose` re-runs a step function on
sub-batches (isolated, :mod:`.isolation`), decides the cause (:mod:`.cause`), searches the
samples (:mod:`.bisection`) and localises the origin (:mod:`.localization`). ``replay`` uses it
without a Trainer. Imports :mod:`lightning_nanguard.detect` and :mod:`lightning_nanguard.core`.
"""
