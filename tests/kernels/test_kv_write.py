"""kernels/kv_write.py: the Triton KV-cache write against its reference and the engine's write_kv.

On the CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.attention.torch_backend import write_kv
from kvbatch.kernels.kv_write import write_kv_cache, write_kv_cache_ref


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
GUARD = 64  # NaN elements on each side of the cache: a stray write lands there


def _poisoned_cache(shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN cache that is a view into a larger NaN buffer, so writes outside it show."""
    numel = torch.Size(shape).numel()
    buf = torch.full((numel + 2 * GUARD,), float("nan"), dtype=dtype, device=_device())
    return buf, buf[GUARD : GUARD + numel].view(shape)


def _slots(num_tokens: int, num_slots: int, num_padding: int, dtype) -> torch.Tensor:
    """Distinct valid slots, with `num_padding` rows at random places set negative."""
    slots = torch.randperm(num_slots)[:num_tokens]
    pad = torch.randperm(num_tokens)[:num_padding]
    slots[pad] = torch.tensor([-1, -7, -(num_slots + 3)])[torch.arange(num_padding) % 3]
    return slots.to(dtype=dtype, device=_device())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "num_tokens, num_blocks, block_size, num_kv_heads, head_dim, num_padding",
    [
        (1, 2, 4, 1, 16, 0),
        (1, 2, 4, 2, 16, 1),  # a lone padding row writes nothing
        (7, 4, 16, 2, 64, 2),
        (13, 3, 8, 3, 128, 5),  # non-power-of-2 kv heads
        (33, 5, 16, 8, 64, 0),
    ],
)
def test_matches_reference(
    dtype,
    slot_dtype,
    num_tokens,
    num_blocks,
    block_size,
    num_kv_heads,
    head_dim,
    num_padding,
    rows_per_program,
):
    torch.manual_seed(num_tokens * 31 + head_dim)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    buf, cache = _poisoned_cache(shape, dtype)
    ref_buf, ref_cache = _poisoned_cache(shape, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=_device())
    v = torch.randn_like(k)
    slots = _slots(num_tokens, num_blocks * block_size, num_padding, slot_dtype)

    write_kv_cache(cache, k, v, slots)
    write_kv_cache_ref(ref_cache, k, v, slots)

    torch.testing.assert_close(buf, ref_buf, rtol=0, atol=0, equal_nan=True)
    # Exactly the valid slots were written; every other slot and the guards are still NaN.
    written = ~cache.isnan().view(2, -1, num_kv_heads * head_dim).all(dim=-1)  # [2, slots]
    expected = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=_device())
    expected[slots[slots >= 0].long()] = True
    assert torch.equal(written, expected.expand(2, -1))
    assert buf[:GUARD].isnan().all() and buf[-GUARD:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_k_v_from_fused_qkv(dtype):
    """k and v as slices of one [T, (heads + 2 * kv_heads) * head_dim] projection output."""
    torch.manual_seed(1)
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 32
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    qkv = qkv.to(_device())
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    _, cache = _poisoned_cache((2, 2, 8, num_kv_heads, head_dim), dtype)
    ref_cache = cache.clone()
    slots = torch.tensor([9, -1, 0, 15, 4], device=_device())

    write_kv_cache(cache, k, v, slots)
    write_kv_cache_ref(ref_cache, k.contiguous(), v.contiguous(), slots)

    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_engine_write_kv(dtype):
    """With no padding rows the reference is exactly the engine's write_kv."""
    torch.manual_seed(2)
    shape = (2, 3, 4, 2, 16)
    cache = torch.randn(shape, dtype=dtype, device=_device())
    engine_cache = cache.clone()
    k = torch.randn(6, 2, 16, dtype=dtype, device=_device())
    v = torch.randn_like(k)
    slots = torch.tensor([11, 0, 5, 3, 8, 1], device=_device())

    write_kv_cache_ref(cache, k, v, slots)
    write_kv(engine_cache, k, v, slots)

    assert torch.equal(cache, engine_cache)


def test_no_tokens_is_a_no_op():
    _, cache = _poisoned_cache((2, 1, 4, 1, 16), torch.float32)
    empty = torch.empty(0, 1, 16, device=_device())
    write_kv_cache(cache, empty, empty, torch.empty(0, dtype=torch.int64, device=_device()))
    assert cache.isnan().all()


def test_shape_mismatch_names_the_shapes():
    cache = torch.zeros(2, 1, 4, 2, 16, device=_device())
    k = torch.zeros(3, 1, 16, device=_device())
    with pytest.raises(ValueError, match=r"\[T, 2, 16\]"):
        write_kv_cache(cache, k, k, torch.zeros(3, dtype=torch.int64, device=_device()))
