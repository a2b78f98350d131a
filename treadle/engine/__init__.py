"""The engine: EngineCore's step loop and the offline LLM API built on it."""
