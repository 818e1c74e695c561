"""Export in the speculators P-EAGLE format that vLLM serves with parallel drafting."""
