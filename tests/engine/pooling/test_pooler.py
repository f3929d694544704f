"""The pooler alone: chunks spread over steps, against the pooling formulas on whole prompts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbatch.engine.pooling.config import PoolingConfig, PoolingMethod
from kvbatch.engine.pooling.pooler import Pooler, PoolingChunk

LAST, MEAN, CLS = PoolingMethod.LAST, PoolingMethod.MEAN, PoolingMethod.CLS


def formula(states: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """states: [prompt_len, hidden] of one whole prompt."""
    v = {LAST: states[-1], MEAN: states.mean(0), CLS: states[0]}[config.method]
    return F.normalize(v, dim=-1) if config.normalize else v


def test_chunks_over_steps_match_the_formulas():
    """Three requests (mean, CLS, last; normalised or not) with prompts cut into chunks of
    different sizes, sharing steps with rows of other requests."""
    g = torch.Generator().manual_seed(0)
    configs = {
        "m": PoolingConfig(MEAN, normalize=False),
        "c": PoolingConfig(CLS, normalize=True),
        "l": PoolingConfig(LAST, normalize=True),  # ends beside "m": rows normalised apart
    }
    lens = {"m": 11, "c": 7, "l": 9}
    states = {k: torch.randn(n, 8, generator=g) for k, n in lens.items()}
    cuts = {"m": [4, 5, 2], "c": [3, 4, 0], "l": [1, 0, 8]}  # tokens of each step (0: absent)
    pooler = Pooler()
    for key in configs:
        pooler.add_request(key)
    got = {}
    done_at = {}
    computed = dict.fromkeys(lens, 0)
    for step in range(3):
        rows = [torch.randn(2, 8, generator=g)]  # another request's rows come first
        chunks = []
        first_row = 2
        for key, n in ((k, cuts[k][step]) for k in configs):
            if not n:
                continue
            start = computed[key]
            rows.append(states[key][start : start + n])
            chunks.append(PoolingChunk(key, configs[key], first_row, start, n, lens[key]))
            first_row += n
            computed[key] += n
        done, vectors = pooler.add_step(torch.cat(rows), chunks)
        for key, v in zip(done, vectors if vectors is not None else []):
            got[key], done_at[key] = v, step
    assert done_at == {"c": 1, "m": 2, "l": 2}
    for key, config in configs.items():
        assert torch.allclose(got[key], formula(states[key], config), atol=1e-6)
    assert len(pooler) == pooler.num_partial == 0
    assert not pooler.active


def test_a_restart_at_position_zero_drops_the_old_sum():
    pooler = Pooler()
    mean = PoolingConfig(MEAN, normalize=False)
    states = torch.arange(12.0).view(6, 2)
    pooler.add_step(states[:3], [PoolingChunk("r", mean, 0, 0, 3, 6)])
    # preempted and recomputed from scratch: the first chunk again, then the rest
    pooler.add_step(states[:3], [PoolingChunk("r", mean, 0, 0, 3, 6)])
    _, v = pooler.add_step(states[3:], [PoolingChunk("r", mean, 0, 3, 3, 6)])
    assert torch.equal(v[0], states.mean(0))


@pytest.mark.parametrize("method", [MEAN, CLS])
def test_rows_never_seen_are_an_error_not_a_wrong_vector(method):
    """A request that pools every row but starts past position 0 (a prefix hit) fails loudly."""
    chunk = PoolingChunk("r", PoolingConfig(method), 0, 4, 2, 6)
    with pytest.raises(RuntimeError, match="must not take prefix hits"):
        Pooler().add_step(torch.zeros(2, 4), [chunk])
