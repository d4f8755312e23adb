"""How the services talk: gRPC servers and channels, the step socket, tensors on the wire, auth and TLS.

Knows no model and no service: the services build on it.
"""
