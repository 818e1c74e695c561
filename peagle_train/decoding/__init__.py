"""Reference decoder (target + P-EAGLE draft) and acceptance evaluation."""
