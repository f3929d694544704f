"""Scheduling: which sequences run each step, and how many prompt tokens a step may take."""
