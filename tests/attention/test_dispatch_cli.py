"""``pagedhybrid dispatch explain CONTRACT.json`` (``pagedhybrid.attention.cli``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from contract_builders import decode_contract, qwen3_contract

from pagedhybrid.attention.cli import explain_main, main


def _write(tmp_path: Path, obj: object) -> str:
    path = tmp_path / "contract.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_explain_refuses_auto_at_cp2_and_lists_every_backend(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, qwen3_contract().to_dict())
    assert main(["dispatch", "explain", path]) == 1
    text = capsys.readouterr().out
    assert "TP=2 CP=2" in text and "REFUSED: CP=2 requires an explicitly named backend" in text
    assert "torch_varlen: CP=2 is unsupported; deterministic CP (out, lse) merge is unsupported" \
        in text
    assert "paged_attention_reference: CP=2 is unsupported; attention-domain LSE export" in text


def test_explain_selected_backend_with_file_level_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"contract": qwen3_contract().to_dict(),
                             "requested_backend": "deterministic_cp"})
    assert explain_main(path) == 0
    text = capsys.readouterr().out
    assert "selected: deterministic_cp (deterministic, platform cpu) fallback=no" in text
    assert "deterministic_cp: selected" in text


def test_explain_json_shows_decode_fallback_provenance(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, decode_contract().to_dict())
    assert main(["dispatch", "explain", path, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["selected"] == "deterministic_cp" and d["fallback"] is True
    assert "mode=decode is unsupported" in d["provenance"]["prior_rejections"]["torch_varlen"]
    assert d["provenance"]["contract"]["kv_cache"]["page_size"] == 4


def test_explain_rejects_an_invalid_contract_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = qwen3_contract().to_dict()
    bad["sharding"]["local_q_heads"] = 8
    assert explain_main(_write(tmp_path, bad)) == 2
    assert "'local_q_heads' must equal global_q_heads / tp_world_size" in capsys.readouterr().err
