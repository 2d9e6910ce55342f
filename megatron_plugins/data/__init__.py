"""Data sources (lead's package)."""
