"""splitspec: DFlash block drafting + DDTree tree verification as three gRPC services."""

__version__ = "0.1.0"
