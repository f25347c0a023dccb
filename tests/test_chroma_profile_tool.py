"""tools/profile_chroma_blocks.py (where a Chroma step's GPU time goes, per block) runs end to end at tiny widths on
the CPU: the three variants, each with a time per block and the cut text shorter than the padded one."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import profile_chroma_blocks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tiny_profile_writes_the_three_variants(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert profile_chroma_blocks.main(["--tiny", "--iters", "1", "--rows", "3", "--caption_tokens", "4",
                                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["chroma masked 512", "chroma cut", "flux 512"]
    assert rows[1]["text_tokens"] == 5 < rows[0]["text_tokens"] == rows[2]["text_tokens"]
    for r in rows:
        assert r["double_ms"] > 0 and r["single_ms"] > 0
        assert r["stack_ms"] == pytest.approx(19 * r["double_ms"] + 38 * r["single_ms"], abs=0.1)
    assert "Name" in capsys.readouterr().out  # the profiler's kernel table
