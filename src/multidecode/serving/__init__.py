"""Serving: an OpenAI-compatible HTTP server whose concurrent requests decode as one forest.

This package is HTTP and the OpenAI protocol only; the engine thread, jobs, admission limits and
the prefix index are the forest runtime (`multidecode.runtime`), which the batch job drives too.

- `protocol`: the OpenAI request schema, checked, turned into runtime jobs; response shapes.
- `app`: the FastAPI application (routes, errors in OpenAI's shape, streaming, auth, metrics),
  and the uvicorn server that drains on SIGTERM.
- `static/index.html`: the live page.
"""
