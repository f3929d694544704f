"""Structured outputs: a grammar (from a JSON schema) constrains which tokens may come next."""
