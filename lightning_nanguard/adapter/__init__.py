"""The Lightning adapter: ``NanGuard``'s hooks, the step controller and the strategy wrapper.

The only layer that knows the Trainer. ``adapter/<name>.py`` is the Lightning side of the
Trainer-free module or stage of the same name (``adapter/spikes.py`` of ``detect/spikes.py``,
``adapter/syncfree.py`` of ``detect/syncfree.py``, ``adapter/diagnosis.py`` of
``diagnose/diagnosis.py``, ``adapter/recovery.py`` of ``recover/recovery.py``); the other modules
here have no Trainer-free half. May import every layer below it.
"""
