"""Markdown report of committed/fresh results."""
