"""The target (verifier): loading, and capture of aux hidden states and final hidden state."""
