"""Acceptance evaluation: benchmark prompts (benchmarks), decoding them resumably (run), figures and files (report)."""
