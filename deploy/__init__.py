"""CLI, local launcher and deployment helpers."""
