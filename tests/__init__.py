"""The test suite: `pytest` from the checkout root (README, Tests). Helpers import as ``tests.NAME``."""
