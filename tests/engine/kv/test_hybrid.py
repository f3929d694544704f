"""engine/kv/hybrid.py against a brute-force simulation of what the KV tensors hold.

Random jobs (prompts sharing prefixes, chunked prefills, decodes, n > 1 forks, speculative
rollbacks, preemptions) drive the manager as the scheduler does. Beside it, a fake KV cache
records, for every slot of every group, which token prefix was last written there. Each
chunk writes its positions into its tables' slots and then reads every key each of its
queries sees (all earlier keys in the full group, the last `window` in a window group): each
read must find its slot holding exactly that prefix. A prefix hit that lacked a block, a block
released too early, or a block given to two sequences fails there.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.kv.hybrid import HybridKVCacheManager
from kvbatch.engine.kv.kv_cache import KVCacheManager
from kvbatch.engine.kv.layout import plan_layout
from kvbatch.engine.kv.window_group import DROPPED

LAYOUTS = {
    "gemma3": [7, 7, None, 7, 7, None],  # 2 full, 4 window layers: 3 groups of 2
    "gemma2": [5, None, 5, None],
    "two-windows": [5, 9, None, 9, 5, None],
    "mistral": [6, 6],  # no full layer: group 0 keeps identities only
}


class FakeKV:
    """What each group's slots hold: the token prefix (as a tuple) last written there."""

    def __init__(self, kv: HybridKVCacheManager, bs: int) -> None:
        self.kv, self.bs = kv, bs
        self.slots: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def groups(self):
        """(index, window, table source) of the groups that hold KV."""
        out = []
        if self.kv.full_has_kv:
            out.append((0, None, self.kv.full))
        out += [(1 + i, w.window, w) for i, w in enumerate(self.kv.windows)]
        return out

    def compute(self, seq_id, tokens: list[int], start: int, n: int) -> None:
        for g, window, src in self.groups():
            table = src.block_table(seq_id)
            for p in range(start, start + n):
                b = table[p // self.bs]
                assert b != DROPPED, f"group {g}: position {p} has no block"
                self.slots[(g, b, p % self.bs)] = tuple(tokens[: p + 1])
            for q in range(start, start + n):
                first = 0 if window is None else max(0, q - window + 1)
                for p in range(first, q + 1):
                    b = table[p // self.bs]
                    assert b != DROPPED, f"group {g}: query {q} reads released key {p}"
                    got = self.slots.get((g, b, p % self.bs))
                    assert got == tuple(tokens[: p + 1]), (
                        f"group {g} (window {window}): query {q} of {seq_id} reads key {p} "
                        f"from block {b}, which holds another prefix"
                    )


def prompts_from(rng: random.Random, num: int, vocab: int) -> list[list[int]]:
    """Prompts sharing prefixes at several levels (a system prompt, documents, questions)."""
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in range(2)]
    docs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    return [
        rng.choice(systems)
        + rng.choice(docs)
        + [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        for _ in range(num)
    ]


def run_job(kind: str, seed: int, num_blocks: int, bs: int, caching: bool = True):
    rng = random.Random(seed)
    layout = plan_layout(LAYOUTS[kind])
    max_chunk = 6
    waiting = list(enumerate(prompts_from(rng, 8, 5)))
    # the engine's floor (engine/kv/sizing.py): the pool holds its longest request (a prompt,
    # 8 outputs of up to 3 tokens), so an empty pool always admits a chunk
    longest = max(len(p) for _, p in waiting) + 8 * 3
    num_blocks = max(num_blocks, layout.blocks_per_seq(longest, bs, max_chunk))
    kv = HybridKVCacheManager(layout, num_blocks, bs, caching, num_identity_blocks=4 * num_blocks)
    fake = FakeKV(kv, bs)
    running: dict[int, dict] = {}
    next_id = 100
    hits = []
    for _ in range(400):
        if not waiting and not running:
            break
        op = rng.random()
        if waiting and (op < 0.3 or not running):
            sid, prompt = waiting[0]
            computed = kv.get_computed_blocks(prompt)
            n = min(len(prompt) - computed.num_tokens, rng.randint(1, max_chunk))
            if not kv.allocate_slots(sid, prompt, n, computed):
                if not running:
                    raise AssertionError("an empty pool refused a chunk")
                victim = rng.choice(list(running))  # preempt: free and wait again
                kv.free(victim)
                waiting.append((victim, running.pop(victim)["tokens"]))
                kv.check_integrity()
                continue
            waiting.pop(0)
            hits.append(computed.num_tokens)
            fake.compute(sid, prompt, computed.num_tokens, n)
            running[sid] = dict(
                tokens=list(prompt), done=computed.num_tokens + n, prompt=len(prompt), out=0
            )
        else:
            sid = rng.choice(list(running))
            s = running[sid]
            tokens = s["tokens"]
            if s["done"] < s["prompt"]:  # the next prefill chunk
                n = min(s["prompt"] - s["done"], rng.randint(1, max_chunk))
                if kv.allocate_slots(sid, tokens, n):
                    fake.compute(sid, tokens, s["done"], n)
                    s["done"] += n
            elif s["out"] >= 8 or rng.random() < 0.05:  # finished
                kv.free(sid, tokens)
                del running[sid]
            elif rng.random() < 0.15 and s["out"] == 0:  # n > 1: a child shares the prompt
                child = next_id
                next_id += 1
                shared = kv.fork(sid, child, s["prompt"])
                assert shared % bs == 0 and shared <= s["prompt"]
                if shared:
                    running[child] = dict(
                        tokens=list(tokens[: s["prompt"]]),
                        done=shared,
                        prompt=s["prompt"],
                        out=0,
                    )
            elif rng.random() < 0.3:  # speculative: the token, 2 drafts, some accepted
                tokens.append(rng.randrange(5))
                drafts = [rng.randrange(5) for _ in range(2)]
                if kv.allocate_slots(sid, tokens, 3):
                    fake.compute(sid, tokens + drafts, s["done"], 3)
                    accepted = rng.randint(0, 2)
                    tokens.extend(drafts[:accepted])
                    s["done"] += 1 + accepted
                    kv.truncate(sid, tokens[: s["done"]], s["done"])
                    s["out"] += 1 + accepted
                else:
                    tokens.pop()
            else:  # a decode
                tokens.append(rng.randrange(5))
                if kv.allocate_slots(sid, tokens, 1):
                    fake.compute(sid, tokens, s["done"], 1)
                    s["done"] += 1
                    s["out"] += 1
                else:
                    tokens.pop()
        kv.check_integrity()
        for sid, s in running.items():  # a window group holds its window, not the sequence
            for w, group in zip(kv.windows, layout.groups[1:]):
                assert w.num_held(sid) <= group.blocks_per_seq(s["done"] + 3, bs, max_chunk)
    for sid, s in list(running.items()):
        kv.free(sid, s["tokens"])
    kv.check_integrity()
    assert kv.num_free_blocks == num_blocks
    return hits


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(sorted(LAYOUTS)),
    seed=st.integers(0, 10**6),
    num_blocks=st.integers(24, 80),
    bs=st.sampled_from([2, 4]),
    caching=st.booleans(),
)
def test_every_read_finds_its_key(kind, seed, num_blocks, bs, caching):
    run_job(kind, seed, num_blocks, bs, caching)


def test_a_window_group_releases_what_left_the_window():
    layout = plan_layout([4, None])
    kv = HybridKVCacheManager(layout, 64, 4)
    prompt = list(range(40))
    assert kv.allocate_slots("a", prompt, 40, kv.get_computed_blocks(prompt))
    (window,) = kv.windows
    assert window.num_held("a") == 10  # a chunk holds its blocks while it is computed
    prompt.append(1)
    assert kv.allocate_slots("a", prompt, 1)
    # the query at 40 reads keys 37..40: blocks 9 and 10 only
    assert window.block_table("a")[:9] == [DROPPED] * 9
    assert window.num_held("a") == 2
    assert len(kv.full.block_table("a")) == 11
    assert kv.num_free_blocks == 64 - 11 - 2
    kv.check_integrity()


def test_a_prefix_hit_needs_the_windows_blocks_too():
    """The window group's last blocks of a prefix are evicted while group 0's stay cached:
    the hit is cut back to where the window group still has what the first query reads."""
    layout = plan_layout([4, None])
    kv = HybridKVCacheManager(layout, 40, 4)
    prompt = list(range(33))
    assert kv.allocate_slots("a", prompt, 33, kv.get_computed_blocks(prompt))
    # 8 + 8 full blocks cached; the partial ones join the head. The window group frees first,
    # so its cached blocks are evicted first, its last (block 7) first of all.
    kv.free("a", prompt)
    assert kv.get_computed_blocks(prompt).num_tokens == 32
    other = [100 + t for t in range(52)]  # 13 + 13 blocks: 24 uncached, then 2 cached
    assert kv.allocate_slots("b", other, 52, kv.get_computed_blocks(other))
    hit = kv.get_computed_blocks(prompt)
    # window blocks 7 and 6 are gone: a query at 32 reads block 7, one at 28 reads 6 and 7,
    # one at 24 reads block 5 only
    assert hit.num_tokens == 24
    (table,) = hit.window_block_ids
    assert table[:5] == [DROPPED] * 5 and DROPPED not in table[5:]
    assert kv.allocate_slots("c", prompt, 33 - 24, hit)
    kv.check_integrity()


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_with_room_to_spare_the_hits_equal_one_table(kind):
    """Nothing evicted: the window groups lose no prefix hit against a single table."""
    for seed in range(5):
        rng = random.Random(seed)
        prompts = prompts_from(rng, 8, 3)
        layout = plan_layout(LAYOUTS[kind])
        hybrid = HybridKVCacheManager(layout, 4096, 2, num_identity_blocks=4096)
        plain = KVCacheManager(4096, 2)
        for i, p in enumerate(prompts):
            a, b = hybrid.get_computed_blocks(p), plain.get_computed_blocks(p)
            assert a.num_tokens == b.num_tokens, (kind, seed, i)
            assert hybrid.allocate_slots(i, p, len(p) - a.num_tokens, a)
            assert plain.allocate_slots(i, p, len(p) - b.num_tokens, b)
            hybrid.free(i, p)
            plain.free(i, p)
        hybrid.check_integrity()
