"""The OpenAI Batch format: input lines, their validation, and the output and error lines."""
