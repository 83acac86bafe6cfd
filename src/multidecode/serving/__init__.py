"""Serving: an OpenAI-compatible HTTP server whose concurrent requests decode as one forest.

- `radix.PrefixIndex`: which prompt prefixes are cached in the forest, and at which node.
- `forest_server.ForestServer`: the engine thread: one scheduler, requests admitted between
  steps (continuous batching), prefix hits, admission caps, cancellation, draining.
- `protocol`: the OpenAI request schema, checked, turned into internal requests; responses.
- `app`: the FastAPI application (routes, errors in OpenAI's shape, streaming, auth, metrics).
"""
