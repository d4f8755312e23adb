"""Target worker: tree verification, KV cache and the decoding rule over gRPC."""
