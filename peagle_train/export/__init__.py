"""Export in the speculators format (P-EAGLE, EAGLE-3 or DFlash) that vLLM serves: write, read back, validate."""
