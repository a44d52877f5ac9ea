"""Uncertainty scores and metrics (numpy only: safe to import on an edge device)."""
