"""When a sequence stops: EOS, stop token ids, max_tokens, the context limit, stop strings.

Stop strings are matched on the decoded output after every token, and the text is cut before
the stop string, which never appears in the output.
"""

from __future__ import annotations

from kvbatch.engine.core.sequence import Sequence


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer) -> None:
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def check(self, seq: Sequence, token: int) -> bool:
        """Called after `token` was appended; sets finish_reason and returns True to stop."""
        p = seq.params
        if not p.ignore_eos and token in self.eos:
            seq.finish_reason, seq.stop_reason = "stop", None
            return True
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return True
        if p.stop and self._hit_stop_string(seq):
            return True
        # known tokens only: with async scheduling the next token may already be pending
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _hit_stop_string(self, seq: Sequence) -> bool:
        # Checked after every token, so a new occurrence ends in the newest token's text and
        # spans at most as many tokens as it has bytes (a token decodes to >= 1 byte): only a
        # short tail is decoded each step, the whole output once there is a candidate. A few
        # more tokens in front keep a character split across tokens, or a leading space that a
        # tokenizer drops at the start of a decode, away from the occurrence.
        stops = seq.params.stop
        window = max(len(stop.encode()) for stop in stops) + 4
        if seq.num_output_tokens > window:
            tail = self.decode(seq.token_ids[-window:])
            if not any(stop in tail for stop in stops):
                return False
        text = self.decode(seq.output_token_ids)
        best = None
        for stop in seq.params.stop:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        seq.output_text = text[: best[0]]
        seq.finish_reason, seq.stop_reason = "stop", best[1]
        return True

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
