"""Keychain: a long-horizon tool task whose every episode needs one tool call per hop.

The sandbox knows a function `hop(key)` that maps a four-digit key to the next one (a salted SHA-256,
so nothing in the prompt predicts it); the prompt gives a start key and a number of hops, 6 to 9 by
default, and the answer is the key reached after the last hop. `hop` may be called once per code block
— a second call in the same block raises — so an episode is one tool turn per hop, and its history of
turns and outputs grows past a small model's context budget: what `loop.context.compaction` is for
(docs/agent_loop.md, "Managed contexts"). Scored by `exact_match` on the boxed key.

* `hop_key`: the map, here; `SANDBOX_PREAMBLE`: the same map as the code the task prepends to every
  block it runs (`loop.preamble`), with the once-per-block rule;
* `generate_keychain_rows`: seeded instances `{"start", "hops", "answer"}`;
* `solver_turns`: the turns a policy that follows the chain writes — the warm start's demonstrations.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

SALT = "vcpo-keychain-v1"
"""Part of the map: changing it makes another task."""


def hop_key(key: int) -> int:
    """The key after `key` (1000..9999)."""
    digest = hashlib.sha256(f"{SALT}:{int(key)}".encode()).hexdigest()
    return int(digest, 16) % 9000 + 1000


SANDBOX_PREAMBLE = f'''import hashlib as _hashlib
_hops_in_this_block = [0]


def hop(key):
    """The key after `key`; once per code block."""
    _hops_in_this_block[0] += 1
    if _hops_in_this_block[0] > 1:
        raise RuntimeError("hop() may be called only once per code block")
    digest = _hashlib.sha256(f"{SALT}:{{int(key)}}".encode()).hexdigest()
    return int(digest, 16) % 9000 + 1000
'''
"""`hop` inside the sandbox, prepended to every block the task runs (`loop.preamble`)."""


def chain(start: int, hops: int) -> list[int]:
    """The keys visited: start, then one per hop."""
    keys = [start]
    for _ in range(hops):
        keys.append(hop_key(keys[-1]))
    return keys


def generate_keychain_rows(num_samples: int, seed: int, *, min_hops: int = 6, max_hops: int = 9
                           ) -> list[dict[str, Any]]:
    """`num_samples` instances `{"start": int, "hops": int, "answer": str}`: a start key uniform in
    1000..9999, a number of hops uniform in [min_hops, max_hops], the key after the last hop. The same
    arguments always give the same rows."""
    if not 1 <= min_hops <= max_hops:
        raise ValueError(f"keychain: need 1 <= min_hops <= max_hops, got {min_hops}, {max_hops}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        start, hops = rng.randint(1000, 9999), rng.randint(min_hops, max_hops)
        rows.append({"start": start, "hops": hops, "answer": str(chain(start, hops)[-1])})
    return rows


HOP_TURN = "Hop {index} of {hops}: the key is {key}.\n```python\nprint(hop({key}))\n```\n"
FINAL_TURN = "After {hops} hops the key is {key}, so the answer is \\boxed{{{key}}}."
SUMMARY = " Hop {index} of {hops} is done; the current key is {key}."


def solver_turns(start: int, hops: int) -> list[str]:
    """The model turns of an episode that follows the chain: one `hop` call per turn, then the answer."""
    keys = chain(start, hops)
    turns = [HOP_TURN.format(index=i + 1, hops=hops, key=keys[i]) for i in range(hops)]
    return [*turns, FINAL_TURN.format(hops=hops, key=keys[-1])]


def solver_summary(start: int, hops: int, done: int) -> str:
    """What a policy that follows the chain writes when asked to summarise after `done` hops."""
    return SUMMARY.format(index=done, hops=hops, key=chain(start, done)[-1])
