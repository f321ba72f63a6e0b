"""``pagedhybrid generate`` / ``run`` front ends (engine.cli) on the tiny checkpoint."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedhybrid.models.qwen35 import ByteTokenizer
from pagedhybrid.serve.offline_cli import (
    add_generate_arguments,
    add_run_arguments,
    generate_main,
    run_main,
)


def parse(adder: Callable[[argparse.ArgumentParser], None], argv: list[str]
          ) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    adder(p)
    return p.parse_args(argv)


def test_generate_json_matches_hf(tiny_dir: Path, hf_greedy: Callable[..., list[int]],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["Hello there", "A much longer prompt, to be chunked and batched."]
    args = parse(add_generate_arguments, [
        "--model", str(tiny_dir), "--prompt", *prompts, "--max-tokens", "6", "--ignore-eos",
        "--json", "--num-blocks", "16", "--max-num-batched-tokens", "16"])
    assert generate_main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    tok = ByteTokenizer()
    for rec, prompt in zip(doc["outputs"], prompts, strict=True):
        assert rec["prompt"] == prompt and rec["finish_reason"] == "length"
        assert rec["token_ids"] == hf_greedy(tok.encode(prompt), 6)
        assert rec["text"] == tok.decode(rec["token_ids"])
    assert doc["throughput"]["generated_tokens_per_s"] > 0


def test_generate_stream_and_errors(tiny_dir: Path, hf_greedy: Callable[..., list[int]],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(add_generate_arguments, [
        "--model", str(tiny_dir), "--prompt", "abc", "--prompt", "defgh", "--max-tokens", "4",
        "--ignore-eos", "--stream", "--json", "--num-blocks", "8"])
    assert generate_main(args) == 0
    captured = capsys.readouterr()
    events = [json.loads(line) for line in captured.out.splitlines()]
    for prompt in ("abc", "defgh"):
        mine = [e for e in events if e["request_id"].endswith(str(["abc", "defgh"].index(prompt)))]
        assert [t for e in mine for t in e["new_token_ids"]] == hf_greedy(list(prompt.encode()), 4)
        assert mine[-1]["finished"] and sum(e["finished"] for e in mine) == 1
    assert "tok/s" in captured.err
    too_long = parse(add_generate_arguments, [
        "--model", str(tiny_dir), "--prompt", "x" * 40, "--num-blocks", "2"])
    assert generate_main(too_long) == 2
    assert "error:" in capsys.readouterr().err


def test_run_main_serves_the_demo(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(add_run_arguments, ["--model", str(tiny_dir), "--num-blocks", "24"])
    assert run_main(args) == 0
    out = capsys.readouterr().out
    assert "requests" in out and "abort" in out and "tok/s" in out
    assert re.search(r"24/24 pages \(\d+ of them cached prefix pages\) and 4/4 slots free", out)
    assert "prefix cache:" in out


def test_run_on_the_built_in_model_prints_english(capsys: pytest.CaptureFixture[str]) -> None:
    """``make run``'s job: the trained built-in model streams readable text, not bytes."""
    args = parse(add_run_arguments, [])
    assert run_main(args) == 0
    out = capsys.readouterr().out
    streamed = " ".join(re.findall(r"r\d '([^']*)'", out))  # the per-step text deltas
    words = re.findall(r"[A-Za-z]+", streamed)
    assert len(words) >= 60, streamed
    assert "\\x" not in out and "\ufffd" not in out
    common = {"the", "and", "of", "unto", "he", "that", "shall", "to", "they", "LORD"}
    assert sum(w in common for w in words) >= 15, streamed


def test_generate_batch_invariant_flag(tiny_dir: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    """``--batch-invariant``: the same request alone and in a batch gives the same logprobs."""
    runs = []
    for prompts in (["Hello there"], ["Hello there", "Another prompt, longer than the first"]):
        args = parse(add_generate_arguments, [
            "--model", str(tiny_dir), "--prompt", *prompts, "--max-tokens", "5", "--ignore-eos",
            "--json", "--logprobs", "0", "--num-blocks", "16", "--max-num-batched-tokens", "8",
            "--batch-invariant"])
        assert args.batch_invariant and generate_main(args) == 0
        runs.append(json.loads(capsys.readouterr().out)["outputs"][0])
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert runs[0]["logprobs"] == runs[1]["logprobs"]
