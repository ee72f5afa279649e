"""The benchmarks behind the documentation's cost numbers (``docs/benchmarks.md``, the performance page).

Each module is a script run from the repository root as a module, ``python -m benchmarks.<name>``
(``bash scripts/bench.sh`` runs ``overhead`` and ``compare_anomaly_mode``); ``models.py`` pins the
shapes they share. Studies that are not cost measurements (attention collapse, loss-spike margins,
other precursors) live in ``studies/``.
"""
