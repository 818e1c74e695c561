"""COD sampling, attention masks, losses, metrics and the training loop."""
