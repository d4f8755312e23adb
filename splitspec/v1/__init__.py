"""Generated from protos/ at install time."""
