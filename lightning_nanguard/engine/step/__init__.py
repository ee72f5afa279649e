"""The optimizer step in progress: its window, its flags, the loss-spike watch and sync-free skipping.

The parts the controller (:mod:`lightning_nanguard.engine.controller`) drives at every step, and
nothing about incidents: ``window.py`` keeps what a step must be able to undo, ``check.py`` makes
the step's flags on the device (and ``check_module`` for manual loops), ``spikes.py`` watches the
loss and gradient norm, ``syncfree.py`` skips on the device and reads the flags a step later.
"""
