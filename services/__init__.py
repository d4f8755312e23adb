"""The three gRPC services: gateway (public API, orchestration), draft worker, target worker."""
