"""Studies behind the guard's defaults: attention collapse and its precursors, QK-clip, loss-spike margins.

Each module is a script run from the repository root as a module, ``python -m studies.<name>``;
``common.py`` holds what the attention studies share. Their per-step traces are not committed:
``python -m studies.regenerate`` writes them to ``studies/traces/`` (``README.md`` here says how long
that takes and which numbers the docs cite). The cost benchmarks are in ``benchmarks/``.
"""
