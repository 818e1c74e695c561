"""Data preparation: conversations → token rows (input_ids, loss_mask), draft vocabulary, mask token."""
