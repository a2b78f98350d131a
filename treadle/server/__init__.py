"""The OpenAI-compatible HTTP server (`treadle serve`)."""
