"""Recover: put training back on track. Snapshots, rollback, BatchNorm restore and remedies.

Trainer-free: :class:`~lightning_nanguard.recover.recovery.Recovery` acts on the
:class:`~lightning_nanguard.recover.recovery.TrainingParts` it is handed (module, optimizers,
schedulers, GradScaler), never on a Trainer. Imports the layers below it.
"""
