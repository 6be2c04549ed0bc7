"""Planned stage; see docs/ARCHITECTURE.md."""
