"""scripts/quant_greedy_check.py: its agreement count and its refusal of unknown names (the
run itself is the gpu-check's quant-greedy step, tried in tests/scripts/test_gpu_check.py)."""

from __future__ import annotations

import pytest

from tests.scripts import load_script

check = load_script("quant_greedy_check")


def test_agreement_counts_tokens_before_the_first_difference():
    assert check.agreement([1, 2, 3], [1, 2, 3]) == 3
    assert check.agreement([1, 2, 3], [1, 5, 3]) == 1  # equal again later does not count
    assert check.agreement([1, 2, 3], [9, 2, 3]) == 0
    assert check.agreement([1, 2], [1, 2, 3]) == 2


def test_unknown_models_and_schemes_are_named(capsys):
    with pytest.raises(SystemExit) as e:
        check.main(["--models", "tiny,huge", "--schemes", "fp8,int3"])
    assert e.value.code == 2
    assert "unknown huge, int3" in capsys.readouterr().err
