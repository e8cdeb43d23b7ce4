"""Outrider's built-in plugins: backends, drafters and acceptors."""
