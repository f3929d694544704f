"""kernels/rotary.py: in-place RoPE against its reference and the engine's RotaryEmbedding.

On the CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.layers.rotary import RotaryEmbedding
from kvbatch.engine.model.rope import RopeConfig, inverse_frequencies
from kvbatch.kernels.rotary import apply_rotary_, apply_rotary_ref


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rope(kind: str, head_dim: int) -> RopeConfig:
    if kind == "linear":
        return RopeConfig(head_dim=head_dim, rope_type="linear", scaling={"factor": 4.0})
    if kind == "llama3":
        return RopeConfig(head_dim, theta=500000.0, rope_type="llama3", scaling=LLAMA3_SCALING)
    return RopeConfig(head_dim=head_dim)


def _positions(num_tokens: int) -> torch.Tensor:
    """Random positions up to 131072, with the extremes included."""
    positions = torch.randint(0, 131073, (num_tokens,))
    positions[0] = 131072 if num_tokens > 1 else positions[0]
    positions[-1] = 0 if num_tokens > 2 else positions[-1]
    return positions.to(_device())


def _fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """q, k (strided views into one projection output) and v, poisoned with NaN."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=_device()) * 2
    qkv[:, q_size + kv_size :] = float("nan")  # v: must stay untouched
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["default", "linear", "llama3"])
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim",
    [(1, 2, 1, 16), (7, 8, 2, 64), (5, 4, 4, 128), (3, 6, 2, 80)],  # 80: half not a power of 2
)
def test_matches_reference_on_fused_qkv(
    dtype, kind, num_tokens, num_heads, num_kv_heads, head_dim, rows_per_program
):
    torch.manual_seed(num_tokens * 13 + head_dim)
    qkv, q, k = _fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    ref_qkv = qkv.clone()
    ref_q, ref_k = _fused_qkv_views(ref_qkv, num_heads, num_kv_heads, head_dim)
    positions = _positions(num_tokens)
    inv_freq = inverse_frequencies(_rope(kind, head_dim)).to(_device())

    apply_rotary_(q, k, positions, inv_freq)
    apply_rotary_ref(ref_q, ref_k, positions, inv_freq)

    # Compared as a whole: q and k rotated, v (NaN) untouched.
    torch.testing.assert_close(qkv, ref_qkv, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)
    assert not q.isnan().any() and not k.isnan().any()


def _fused_qkv_views(qkv, num_heads, num_kv_heads, head_dim):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(len(qkv), num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(len(qkv), num_kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_contiguous_q_k_many_heads(dtype):
    """More heads than one loop step of the kernel takes (16), plain contiguous tensors."""
    torch.manual_seed(4)
    q = torch.randn(3, 40, 16, dtype=dtype, device=_device())
    k = torch.randn(3, 20, 16, dtype=dtype, device=_device())
    ref_q, ref_k = q.clone(), k.clone()
    positions = _positions(3)
    inv_freq = inverse_frequencies(_rope("default", 16)).to(_device())

    apply_rotary_(q, k, positions, inv_freq)
    apply_rotary_ref(ref_q, ref_k, positions, inv_freq)

    torch.testing.assert_close(q, ref_q, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(k, ref_k, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["default", "linear", "llama3"])
def test_reference_matches_engine_rotary_embedding(dtype, kind):
    """The reference is the engine's cos_sin + apply to the bit, so it can vouch for the kernel."""
    torch.manual_seed(5)
    head_dim = 64
    rotary = RotaryEmbedding(_rope(kind, head_dim)).to(_device())
    q = torch.randn(9, 4, head_dim, dtype=dtype, device=_device())
    k = torch.randn(9, 2, head_dim, dtype=dtype, device=_device())
    positions = _positions(9)
    cos, sin = rotary.cos_sin(positions, dtype)
    expected_q = RotaryEmbedding.apply(q, cos, sin)
    expected_k = RotaryEmbedding.apply(k, cos, sin)

    apply_rotary_ref(q, k, positions, rotary.inv_freq)

    assert torch.equal(q, expected_q)
    assert torch.equal(k, expected_k)


def test_odd_head_dim_is_refused():
    q = torch.zeros(2, 2, 15, device=_device())
    with pytest.raises(ValueError, match="even"):
        apply_rotary_(q, q, torch.zeros(2, dtype=torch.int64), torch.ones(7))
