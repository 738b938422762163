"""Gradient communication: top-k selectors, error feedback, collectives and DDP comm hooks."""
