"""The test suite; its helpers (checkpoints, fp8, hubserver, ...) are modules of this package: ``tests.checkpoints``."""
