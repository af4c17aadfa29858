#!/usr/bin/env python3
"""Retrain the bundled fixtures (see mtpconvert/fixture/train.py)."""
from mtpconvert.fixture.train import main

if __name__ == "__main__":
    main()
