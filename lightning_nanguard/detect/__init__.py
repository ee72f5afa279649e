"""Detect: is this step healthy? Device-side checks of gradients, losses and BatchNorm statistics.

Trainer-free. The fused check (:mod:`.check`) gives one small flag tensor per step and reads
nothing; :mod:`.confirm` names the non-finite tensors on the bad path; :mod:`.spikes` flags finite
loss spikes; :mod:`.syncfree` lets a step be skipped on the device and its flags read later.
Imports only :mod:`lightning_nanguard.core`.
"""
