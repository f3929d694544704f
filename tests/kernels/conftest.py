"""Fixtures and helpers for the kernel tests: device, dtypes, tolerances, random paged caches.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which mishandles bfloat16 dots, so bfloat16 is tested on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])

# (atol, rtol) for outputs; lse is float32 math over the same inputs, so it is tighter.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@pytest.fixture
def device() -> torch.device:
    if not torch.cuda.is_available():
        from kvbatch.kernels.interpreter import interpreter_problem

        problem = interpreter_problem()
        if problem:
            pytest.fail(problem, pytrace=False)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.fixture(params=[1, 4], ids=lambda rows: f"rows{rows}")
def rows_per_program(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Rows per program of the elementwise kernels under the interpreter: 1, the grid they run
    with when compiled (on the GPU), and 4, blocks of rows with a ragged last block for most
    token counts (the interpreter's own default, 32, runs in every other test). On CUDA both
    run one row per program."""
    import kvbatch.kernels.interpreter as interpreter

    monkeypatch.setattr(interpreter, "INTERPRETED_ROWS_PER_PROGRAM", request.param)
    return request.param


def generator(seed: int) -> torch.Generator:
    """A seeded CPU generator: tensors are drawn on the CPU and moved, so that a test sees the
    same numbers on every device."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, device: torch.device):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel forgets to write fails the test."""
    return torch.full_like(like, float("nan"))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, **kw) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, **kw)


def assert_lse_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Log-sum-exps (float32, -inf where nothing was attended)."""
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected.float(), atol=1e-3, rtol=1e-4)


def make_paged_kv(
    context_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    table_dtype: torch.dtype = torch.int64,
    spare_columns: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random KV cache and block tables for sequences of the given context lengths.

    Blocks are handed out in shuffled order (tables are not contiguous runs), a few blocks stay
    unused, and table entries past a sequence's blocks hold random valid ids (padding is
    arbitrary): a kernel that reads past the context or misorders blocks gets wrong numbers.
    Returns (kv_cache [2, num_blocks, block_size, kv_heads, head_dim], tables [S, max_blocks]).
    """
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    max_blocks = max(needed, default=0) + spare_columns
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen)
    used = 0
    for s, n in enumerate(needed):
        tables[s, :n] = perm[used : used + n]
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return kv_cache.to(device=device, dtype=dtype), tables.to(device=device, dtype=table_dtype)


def gather_context(
    kv_cache: torch.Tensor, table_row: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V [context_len, kv_heads, head_dim] of one sequence, independently of the
    references (used to check the references against SDPA)."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(context_len, device=kv_cache.device)
    blocks = table_row.long()[positions // block_size]
    return kv_cache[0, blocks, positions % block_size], kv_cache[1, blocks, positions % block_size]
