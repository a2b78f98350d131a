"""Model definitions, loading and the built-in demo checkpoint."""
