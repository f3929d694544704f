"""DeviceBlockTables follows the KV manager's tables by the entries that changed."""

from __future__ import annotations

import random

import numpy as np
import torch

from kvbatch.engine.kv.device_tables import DeviceBlockTables
from kvbatch.engine.kv.kv_cache import KVCacheManager
from tests.engine.kv.test_table_rows import random_table_op


def apply(device: DeviceBlockTables, kv: KVCacheManager) -> int:
    """Take kv's changes into `device`; how many entries travelled."""
    changes = kv.take_table_changes()
    device.apply(changes.shape, *(torch.from_numpy(a) for a in changes[:3]))
    return len(changes.rows)


def assert_same(device: DeviceBlockTables, kv: KVCacheManager) -> None:
    host = kv.table_array
    rows, width = host.shape
    copy = device.array.numpy()
    assert copy.shape[0] >= rows and copy.shape[1] >= width
    assert np.array_equal(copy[:rows, :width], host)
    assert not copy[rows:].any() and not copy[:, width:].any()


def test_the_copy_follows_allocation_truncation_free_and_growth():
    """Random allocations, speculative truncations and frees (rows reused, the host array
    growing in rows and width), the changes taken after one to three operations at a time:
    the device copy always equals the host's tables."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=2000, block_size=4, enable_prefix_caching=True)
    device = DeviceBlockTables(torch.device("cpu"))
    live: dict[str, list[int]] = {}
    names = [f"seq{i}" for i in range(90)]  # more than the array's first 64 rows
    sizes = [1, 1, 2, 9, 40, 300]  # decodes, chunks, a long prompt
    for _ in range(400):
        for _ in range(rng.randint(1, 3)):
            random_table_op(kv, live, rng, names, sizes, p_allocate=0.7, p_truncate=0.1)
        apply(device, kv)
        assert_same(device, kv)
    assert kv.table_array.shape[0] > 64 and kv.table_array.shape[1] > 64  # it grew both ways


def test_a_decode_step_sends_only_the_new_block():
    """A 2,049-block context decoding beside short ones: the step's copy carries the block a
    decode opened, not the tables."""
    kv = KVCacheManager(num_blocks=3000, block_size=16, enable_prefix_caching=False)
    device = DeviceBlockTables(torch.device("cpu"))
    assert kv.allocate_slots("long", [1] * 32_768, 32_768)
    for i in range(8):
        assert kv.allocate_slots(f"short{i}", [2] * 16, 16)  # full blocks: the next opens one
    assert apply(device, kv) == 2048 + 8
    assert kv.allocate_slots("long", [1] * 32_769, 1)  # a new block
    for i in range(8):
        assert kv.allocate_slots(f"short{i}", [2] * 17, 1)
    assert apply(device, kv) == 9
    assert_same(device, kv)
    assert kv.allocate_slots("long", [1] * 32_770, 1)  # same block: nothing changes
    assert apply(device, kv) == 0
    rows, _ = kv.table_rows(["long", "short3", "gone"])
    tables = device.gather(torch.from_numpy(rows), 2050).numpy()
    assert tables[0, :2049].tolist() == kv.block_table("long") and tables[0, 2049] == 0
    assert tables[1, :2].tolist() == kv.block_table("short3") and not tables[1, 2:].any()
    assert not tables[2].any()  # an unknown sequence: row 0
