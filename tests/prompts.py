"""Prompt sets used by the engine tests (deterministic)."""

from __future__ import annotations

import random


def mixed_prompts(n: int, max_len: int, vocab: int = 400, seed: int = 0) -> list[list[int]]:
    """``n`` prompts: lengths 1..max_len, duplicates, shared prefixes; token ids >= 4."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    lengths = [1, 2, max_len, max_len - 1, 17, 256, 257]
    for i in range(n):
        if i < len(lengths):
            length = lengths[i]
        else:
            length = rng.choice([rng.randint(1, 64), rng.randint(64, max_len)])
        prompts.append([rng.randrange(4, vocab) for _ in range(length)])
    # a duplicated prompt, and one sharing a long prefix with another
    if n >= 6:
        prompts[n // 2] = list(prompts[3])
        prompts[n // 3] = prompts[2][: max_len // 2] + [rng.randrange(4, vocab) for _ in range(9)]
    return prompts
