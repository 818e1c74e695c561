"""vLLM as the framework's serving, generation and feature engine, run in its own environment."""
