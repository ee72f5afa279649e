"""The Lightning adapter: ``NanGuard``'s hooks, the step controller and the strategy wrapper.

The only layer that knows the Trainer. ``adapter/<name>.py`` is the Lightning side of the
Trainer-free module of the same name: ``check.py`` of ``detect/check.py``, ``spikes.py`` of
``detect/spikes.py``, ``syncfree.py`` of ``detect/syncfree.py``, ``diagnosis.py`` of
``diagnose/diagnosis.py``, ``records.py`` of ``diagnose/records.py``, ``recovery.py`` of
``recover/recovery.py``, ``reporting.py`` of ``reporting/``. The other modules here have no
Trainer-free half: the hooks (``guard.py``), the step controller and what it keeps between hooks
(``controller.py``, ``window.py``, ``state.py``, ``after_step.py``, ``incidents.py``), the strategy
wrapper, index recording and record reading (``strategy.py``, ``indices.py``, ``readers.py``), the
configuration (``config.py``) and the failsafe. May import every layer below.
"""
