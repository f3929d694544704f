"""studies/kv_groups_host.py times both managers on the same decode steps."""

from __future__ import annotations

import json

from studies.kv_groups_host import main


def test_both_managers_are_timed(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--seqs", "4", "--prompt", "40", "--steps", "20", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["one_table_ms"] > 0 and got["window_groups_ms"] > 0
    assert "window groups" in capsys.readouterr().out
