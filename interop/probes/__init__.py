"""One probe per runtime, which ``interop.run`` starts with the runtime venv's Python as
``python -m interop.probes.<probe>`` from the repository root.

A probe is named after its runtime (``mlx_lm``, ``mtplx``, ...). As a module of this package it leaves
the runtime's own package importable under that name; run as a script, with this folder first on
sys.path, it would shadow it.
"""
