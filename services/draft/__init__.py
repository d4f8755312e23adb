"""Draft worker: DFlash block proposals over gRPC."""
