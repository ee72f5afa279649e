"""Decide: what every rank does about a step, from what each rank found. Trainer-free.

:mod:`.policy` turns the ranks' reports into one decision and the shared counters;
:mod:`.agreement` holds the collectives that make ranks agree; :mod:`.messages` words the stop.
Imports only :mod:`lightning_nanguard.core`.
"""
