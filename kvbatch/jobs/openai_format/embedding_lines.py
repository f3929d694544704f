"""The output lines of `/v1/embeddings` requests, built as their inputs' vectors arrive.

A line's inputs run as separate engine requests (each its own prompt, so prefix grouping
orders them with the rest of the job); its answer is written once every input has its vector,
as one CreateEmbeddingResponse body with the vectors in input order. One input the engine
refuses makes the whole line an error record, as OpenAI answers a request all or nothing.
"""

from __future__ import annotations

from kvbatch.jobs.openai_format.pooled_inputs import PooledInputs, refusal
from kvbatch.jobs.openai_format.responses import embedding_line, error_line
from kvbatch.jobs.openai_format.validate import JobRequest, LineError


class EmbeddingLines:
    """Collects each embeddings line's vectors until the line is complete."""

    def __init__(self, model: str, engine, batch_id: str) -> None:
        self.model = model
        self.engine = engine
        self.batch_id = batch_id
        self._inputs = PooledInputs()

    def add(self, req: JobRequest, input_index: int, out) -> dict | None:
        """Record input `input_index`'s output; the line's output (or error) line once all of
        `req.num_inputs` inputs are in, else None."""
        outputs = self._inputs.add(req, input_index, out)
        if outputs is None:
            return None
        refused = refusal(outputs, "input")
        if refused is not None:
            return self._error(req, "invalid_prompt", refused)
        # Imported here, not with the module: the body stacks vectors with torch, and the
        # commands that read shards without answering them (status, finalize) never load it.
        from kvbatch.jobs.openai_format.embedding_body import embedding_response

        try:
            body = embedding_response(
                outputs,
                model=self.model,
                encoding_format=req.encoding_format,
                dimensions=req.dimensions,
                normalize=self.engine.pooling_config.normalize,
            )
        except ValueError as e:  # dimensions larger than the model's vectors
            return self._error(req, "invalid_parameter", str(e))
        return embedding_line(req, body, batch_id=self.batch_id)

    def _error(self, req: JobRequest, code: str, message: str) -> dict:
        err = LineError(req.line, req.custom_id, code, f"line {req.line}: {message}")
        return error_line(err, batch_id=self.batch_id)
