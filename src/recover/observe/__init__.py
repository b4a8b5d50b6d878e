"""Observability: JSONL metrics and events, the live progress display, and plots."""
