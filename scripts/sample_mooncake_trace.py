"""Write a sample Mooncake trace (JSONL), so trace replay needs nothing downloaded.

    python scripts/sample_mooncake_trace.py --out runs/sample-mooncake.jsonl

The trace has the structure Mooncake's published traces have: a few system prompts that
many conversations start with (their hash ids shared), conversations whose later turns
repeat every block of the earlier ones and add new ones, and one-off requests that share
nothing. Timestamps are Poisson arrivals in milliseconds; hash ids name 512-token blocks,
numbered as the generator makes them (the system prompts' first). The same arguments write
the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

BLOCK = 512


def sample_trace(*, requests: int, rate: float, seed: int, system_prompts: int = 3,
                 max_prompt: int = 3500) -> list[dict[str, object]]:
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [fresh(rng.randint(1, 2)) for _ in range(system_prompts)]
    open_conversations: list[tuple[list[int], int]] = []  # (blocks so far, tokens so far)
    rows = []
    t_ms = 0.0
    for _ in range(requests):
        t_ms += rng.expovariate(rate) * 1000
        kind = rng.random()
        if kind < 0.45 and open_conversations:  # the next turn of a conversation
            i = rng.randrange(len(open_conversations))
            blocks, tokens = open_conversations[i]
            tokens += rng.randint(100, 600)
        elif kind < 0.85:  # a conversation opens behind a shared system prompt
            system = rng.choice(systems)
            blocks, tokens = list(system), len(system) * BLOCK + rng.randint(50, 700)
            i = len(open_conversations)
            open_conversations.append((blocks, tokens))
        else:  # a one-off prompt that shares nothing
            blocks, tokens, i = [], rng.randint(200, 2000), -1
        tokens = min(tokens, max_prompt)
        needed = -(-tokens // BLOCK)
        blocks = blocks[:needed] + fresh(max(0, needed - len(blocks)))
        if i >= 0:
            if tokens >= max_prompt:
                open_conversations.pop(i)  # a conversation ends at the context's end
            else:
                open_conversations[i] = (blocks, tokens)
        rows.append({"timestamp": round(t_ms), "input_length": tokens,
                     "output_length": rng.randint(16, 200), "hash_ids": list(blocks)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=5.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt", type=int, default=3500,
                        help="longest prompt in tokens (keep under the server's context)")
    args = parser.parse_args(argv)
    rows = sample_trace(requests=args.requests, rate=args.rate, seed=args.seed,
                        max_prompt=args.max_prompt)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} requests to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
