"""The error of an index run that cannot go on (as against a document that fails: an error
record, kvbatch.index.report.ErrorRecord)."""

from __future__ import annotations


class IndexRunError(Exception):
    """The run cannot go on: a model that does not load, a table whose vectors are another
    model's, another run holding the same run folder. The message says what to fix."""
