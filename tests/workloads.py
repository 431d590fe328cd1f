"""Reference workloads shared by the equivalence tests: a batch of prompts of
mixed lengths where several share a long prefix and one is long enough to be
chunked, with the engine options that force chunking and prefix reuse."""

from __future__ import annotations

import random
from pathlib import Path

import torch

NEW_TOKENS = 8
ENGINE_OPTIONS = dict(chunk_size=16, max_tokens_per_pass=48, kv_capacity_tokens=2048)


def reference_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab) for _ in range(40)]
    prompts = [shared + [rng.randrange(1, vocab) for _ in range(n)] for n in (1, 5, 12, 3)]
    prompts += [[rng.randrange(1, vocab) for _ in range(n)] for n in (2, 9, 70, 1)]
    return prompts


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation by transformers, full recompute at every step, no
    EOS handling (the engine runs with ignore_eos)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def greedy_case(path: Path) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A saved model, the reference prompts and transformers' greedy
    continuations of them in float32: what the equality tests compare with."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = reference_prompts(hf.config.vocab_size)
    return path, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
