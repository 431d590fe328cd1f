"""The requests a benchmark sends: vLLM's `random` dataset (prompts of a
given token length) and its `sharegpt` dataset (the first human turn of
each conversation of a ShareGPT JSON file, the reply's length as the
output length).

Token lengths are counted with a tokenizer when one is at hand (`--tokenizer`,
or the served model's own files); without one a prompt is words, and each
word is taken as one token (a server's usage report then gives the true
counts).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ringserve.models.tokenizer import Tokenizer

# Plain words for prompts when no tokenizer is at hand.
WORDS = (
    "the river runs past an old mill where a miller grinds grain into flour "
    "while children watch boats drift under the stone bridge toward the sea"
).split()
SHAREGPT_MIN_TOKENS = 4  # vLLM drops shorter prompts and replies
SHAREGPT_MAX_PROMPT = 1024  # ... and longer prompts
SHAREGPT_MAX_TOTAL = 2048  # ... and longer prompt + reply


@dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    tokenizer: Tokenizer | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """`n` prompts of `prefix_len` shared tokens then `input_len` (+-
    `range_ratio`) random ones, each asking for `output_len` (+- the same
    ratio) tokens."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), not {range_ratio}")
    rng = random.Random(seed)
    prefix = _random_ids(rng, prefix_len, tokenizer)
    out = []
    for _ in range(n):
        in_len = _around(rng, input_len, range_ratio)
        ids = prefix + _random_ids(rng, in_len, tokenizer)
        out.append(
            SampleRequest(_text(ids, tokenizer), len(ids), _around(rng, output_len, range_ratio))
        )
    return out


def sharegpt_requests(
    path: str | Path,
    n: int,
    *,
    output_len: int | None = None,
    tokenizer: Tokenizer | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """`n` requests from a ShareGPT file: `[{"conversations": [{"from":
    "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}, ...]`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset-path {path}: cannot read ShareGPT JSON ({exc})") from None
    shape = 'a list of {"conversations": [{"from": ..., "value": ...}, ...]}'
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is {shape}")
    try:
        pairs = [
            (str(c[0]["value"]), str(c[1]["value"]))
            for entry in data
            if len(c := entry.get("conversations") or []) >= 2
        ]
    except (KeyError, TypeError, IndexError):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is {shape}") from None
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, reply in pairs:
        prompt_len = _count(prompt, tokenizer)
        reply_len = _count(reply, tokenizer) if output_len is None else output_len
        if prompt_len < SHAREGPT_MIN_TOKENS or (
            output_len is None and reply_len < SHAREGPT_MIN_TOKENS
        ):
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + reply_len > SHAREGPT_MAX_TOTAL:
            continue
        out.append(SampleRequest(prompt, prompt_len, reply_len))
        if len(out) == n:
            return out
    raise ValueError(
        f"{path} has {len(out)} usable conversations (a prompt of {SHAREGPT_MIN_TOKENS} to "
        f"{SHAREGPT_MAX_PROMPT} tokens, {SHAREGPT_MAX_TOTAL} with its reply), fewer than "
        f"--num-prompts {n}"
    )


def _around(rng: random.Random, mean: int, ratio: float) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def _random_ids(rng: random.Random, n: int, tokenizer: Tokenizer | None) -> list[int]:
    top = tokenizer.vocab_size if tokenizer is not None else len(WORDS)
    return [rng.randrange(top) for _ in range(n)]


def _text(ids: list[int], tokenizer: Tokenizer | None) -> str:
    if tokenizer is None:
        return " ".join(WORDS[i] for i in ids)
    return tokenizer.decode(ids)


def _count(text: str, tokenizer: Tokenizer | None) -> int:
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer.encode(text, add_special_tokens=False))
