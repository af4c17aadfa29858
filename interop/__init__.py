"""The interop harness, not installed with mtpconvert: ``python -m interop.run`` from the repository root
(README.md)."""
