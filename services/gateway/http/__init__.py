"""The gateway's OpenAI- and Anthropic-compatible HTTP API (app.py), next to gRPC in one event loop."""
