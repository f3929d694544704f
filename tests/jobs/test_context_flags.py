"""Engine errors name Python keywords; jobs show them as the command line's flags."""

from __future__ import annotations

from kvbatch.engine.kv.sizing import fitted_max_model_len
from kvbatch.jobs.context_flags import as_flags


def test_keywords_become_flags_and_a_python_only_setting_is_left_out():
    try:
        fitted_max_model_len(4, 16, 4096, asked=True)
    except ValueError as e:
        message = as_flags(str(e))
    assert message == (
        "the KV cache holds 64 tokens (4 blocks of 16) but one request may need "
        "--max-model-len 4096: raise --kv-cache-bytes (or --kv-cache-memory-fraction on CUDA) "
        "or lower --max-model-len"
    )


def test_a_keyword_inside_a_word_is_left_alone():
    assert (
        as_flags("my_max_model_len_x and max_model_len") == "my_max_model_len_x and --max-model-len"
    )
