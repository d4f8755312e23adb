"""The ``splitspec`` command line: one module per subcommand that is not a service (services/*/main.py)."""
