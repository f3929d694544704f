"""bench/window_savings.py counts what freeing out-of-window KV blocks would save."""

from __future__ import annotations

from kvbatch.bench.window_savings import footprint, gemma3_config, main, measure


def test_gemma3_27b_holds_one_window_per_local_layer():
    cfg = gemma3_config("gemma-3-27b")
    local = [layer for layer in range(cfg.num_layers) if cfg.is_sliding(layer)]
    assert (len(local), cfg.sliding_window) == (52, 1024)  # five local layers to one global
    # Within the window nothing leaves it: both pools hold the same blocks.
    short = footprint(cfg, 1024)
    assert short.blocks_now == short.blocks_freed == 62 * 64
    # 16k tokens: global layers keep all 1024 blocks, a local one the 65 its window can span.
    long = footprint(cfg, 16384)
    assert (long.blocks_now, long.blocks_freed) == (62 * 1024, 10 * 1024 + 52 * 65)
    assert 0.75 < long.saving < 52 / 62


def test_longer_prompts_gain_more_sequences_at_once(capsys):
    rows = [measure("gemma-3-12b", p, 512) for p in (2048, 32768)]
    assert rows[0].kv_gb_freed < rows[0].kv_gb_now
    assert rows[1].batch_gain > rows[0].batch_gain > 1.5
    main(["--models", "gemma-3-4b", "--prompt-tokens", "8192"])
    assert "| gemma-3-4b | 8,704 |" in capsys.readouterr().out
