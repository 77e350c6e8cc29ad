"""Logging, metrics, progress and plots."""
