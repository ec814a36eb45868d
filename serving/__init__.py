"""`unikv serve`: the OpenAI-compatible HTTP server, its metrics and health view.

The top layer: it imports the engine and nothing imports it (`app`, `protocol`, `metrics`,
`health`, `cli`).
"""
