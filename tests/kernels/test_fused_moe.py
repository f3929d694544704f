"""kernels/fused_moe.py: the grouped-GEMM MoE kernel against its reference, under uneven loads
(experts with no tokens, one expert taking every token, top-1 and top-8, token counts that are
not a multiple of the block), and the reference against a dense per-token loop.

On the CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it): shapes stay
small, the interpreter runs each program in Python."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbatch.kernels.fused_moe import align_to_blocks, fused_moe, fused_moe_ref
from tests.kernels.conftest import assert_close, generator, randn

HIDDEN, INTER = 32, 48  # INTER is not a power of two: the gate|up and down tiles are ragged


def expert_weights(num_experts: int, dtype, device, seed: int = 0):
    g = generator(seed)
    w_gate_up = randn(num_experts, 2 * INTER, HIDDEN, gen=g, dtype=dtype, device=device) * 0.2
    w_down = randn(num_experts, HIDDEN, INTER, gen=g, dtype=dtype, device=device) * 0.2
    return w_gate_up, w_down


def routing(ids: torch.Tensor, device, seed: int = 1):
    """Random positive routing weights for the given expert ids [T, k], summing to one."""
    w = torch.rand(ids.shape, generator=generator(seed)) + 0.1
    return (w / w.sum(-1, keepdim=True)).to(device), ids.to(device)


def distinct_random_ids(num_tokens: int, top_k: int, num_experts: int, seed: int = 2):
    g = generator(seed)
    return torch.stack(
        [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]
    )


def dense_loop(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """Token by token, expert by expert, in float64: what the MoE layer means."""
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            h = w_gate_up[e].double().cpu() @ x[t].double().cpu()
            gate, up = h[:INTER], h[INTER:]
            out[t] += w * (w_down[e].double().cpu() @ (F.silu(gate) * up))
    return out


CASES = {
    # name: (num_tokens, top_k, num_experts, ids or None for random distinct ones)
    "top2-uneven": (13, 2, 6, None),
    "top1": (21, 1, 4, None),
    "top8": (5, 8, 16, None),
    "one-expert-takes-all": (19, 1, 4, torch.full((19, 1), 2)),
    "idle-experts": (17, 2, 8, torch.tensor([[1, 6]] * 9 + [[6, 1]] * 8)),
    "one-token": (1, 2, 4, torch.tensor([[3, 0]])),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernel_matches_reference(case, dtype, device):
    num_tokens, top_k, num_experts, ids = CASES[case]
    if ids is None:
        ids = distinct_random_ids(num_tokens, top_k, num_experts)
    w_gate_up, w_down = expert_weights(num_experts, dtype, device)
    x = randn(num_tokens, HIDDEN, gen=generator(3), dtype=dtype, device=device)
    topk_weights, topk_ids = routing(ids, device)

    out = fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)

    assert out.shape == (num_tokens, HIDDEN) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert_close(out, fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids), dtype)


@pytest.mark.parametrize("block_m", [16, 32])
def test_block_size_does_not_change_the_result(device, block_m):
    """Token counts that are not a multiple of the block, with blocks larger than some
    experts' runs."""
    w_gate_up, w_down = expert_weights(4, torch.float32, device)
    x = randn(23, HIDDEN, gen=generator(4), dtype=torch.float32, device=device)
    topk_weights, topk_ids = routing(distinct_random_ids(23, 2, 4, seed=5), device)
    out = fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, block_m=block_m)
    assert_close(out, fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_several_ragged_tiles_along_n_and_k(device, dtype):
    """Hidden 200 and intermediate 136: each GEMM loops over several K tiles and spans several
    N tiles, the last of each ragged (tiles are at most 128 wide under the interpreter, 64
    compiled)."""
    hidden, inter, num_experts = 200, 136, 4
    g = generator(9)
    w_gate_up = randn(num_experts, 2 * inter, hidden, gen=g, dtype=dtype, device=device) * 0.1
    w_down = randn(num_experts, hidden, inter, gen=g, dtype=dtype, device=device) * 0.1
    x = randn(9, hidden, gen=g, dtype=dtype, device=device)
    topk_weights, topk_ids = routing(distinct_random_ids(9, 2, num_experts, seed=10), device)
    out = fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    assert_close(out, fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids), dtype)


def test_reference_is_the_dense_loop():
    w_gate_up, w_down = expert_weights(6, torch.float32, "cpu")
    x = randn(9, HIDDEN, gen=generator(6), dtype=torch.float32, device="cpu")
    topk_weights, topk_ids = routing(distinct_random_ids(9, 3, 6), "cpu")
    ref = fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids)
    torch.testing.assert_close(
        ref.double(), dense_loop(x, w_gate_up, w_down, topk_weights, topk_ids), atol=1e-5, rtol=1e-5
    )


def test_a_token_routed_nowhere_else_is_unchanged_by_its_neighbours(device):
    """A token's output does not depend on which other tokens share the step."""
    w_gate_up, w_down = expert_weights(4, torch.float32, device)
    x = randn(11, HIDDEN, gen=generator(7), dtype=torch.float32, device=device)
    topk_weights, topk_ids = routing(distinct_random_ids(11, 2, 4, seed=8), device)
    batch = fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    alone = fused_moe(x[4:5], w_gate_up, w_down, topk_weights[4:5], topk_ids[4:5])
    assert torch.equal(batch[4:5], alone)


def test_align_to_blocks_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [0, 2], [0, 1]])  # pairs 0..5
    blocks = align_to_blocks(ids, num_experts=4, block_m=4)
    pairs = blocks.sorted_pairs.tolist()
    used = [b for b in blocks.block_experts.tolist() if b >= 0]
    assert used == [0, 1, 2]  # expert 3 has no tokens and no block
    assert pairs[:4] == [1, 2, 4, 6]  # expert 0's pairs in order, then padding (6 = num pairs)
    assert pairs[4:8] == [5, 6, 6, 6]
    assert pairs[8:12] == [0, 3, 6, 6]
    assert all(p == 6 for p in pairs[12:])
    assert blocks.block_experts.tolist()[3:] == [-1] * (len(blocks.block_experts) - 3)


def test_no_tokens_gives_an_empty_result(device):
    w_gate_up, w_down = expert_weights(4, torch.float32, device)
    x = torch.zeros(0, HIDDEN, device=device)
    ids = torch.zeros(0, 2, dtype=torch.long, device=device)
    assert fused_moe(x, w_gate_up, w_down, ids.float(), ids).shape == (0, HIDDEN)


def test_mismatched_shapes_are_named():
    w_gate_up, w_down = expert_weights(4, torch.float32, "cpu")
    x = torch.zeros(3, HIDDEN + 1)
    ids = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="weight shapes disagree"):
        fused_moe_ref(x, w_gate_up, w_down, ids.float(), ids)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        fused_moe_ref(x[:, :HIDDEN], w_gate_up, w_down, ids[:, :1].float(), ids)
