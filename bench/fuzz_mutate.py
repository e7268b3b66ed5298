"""Input mutation for bench/fuzz.py: bytes-level for the binary decoders, structure-aware for the
JSON and TOML ones. Deterministic for a given `random.Random`."""

from __future__ import annotations

import copy
import json
import random

INTERESTING_BYTES = (0, 1, 0x7F, 0x80, 0xFF)
INTERESTING_INTS = (
    0,
    1,
    -1,
    2**7,
    2**8,
    2**15,
    2**16,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**64 - 1,
)
INTERESTING_JSON = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    -(2**63),
    10**400,
    1e308,
    -1e308,
    0.5,
    "",
    "x" * 4097,
    "\ud800",
    "\x00",
    "<|im_end|>",
    [],
    [[]],
    {},
    {"": None},
)


def mutate_bytes(data: bytes, seeds: list[bytes], rng: random.Random) -> bytes:
    """`data` with 1-4 random edits: flips, interesting values, inserts, deletes, splices."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        at = rng.randrange(len(out) + 1)
        if op == 0 and out:
            at = min(at, len(out) - 1)
            out[at] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[min(at, len(out) - 1)] = rng.choice(INTERESTING_BYTES)
        elif op == 2:
            width = rng.choice((1, 2, 4, 8))
            value = rng.choice(INTERESTING_INTS) % (1 << (8 * width))
            out[at : at + width] = value.to_bytes(width, "little")
        elif op == 3:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 4 and out:
            del out[at : at + rng.randint(1, 16)]
        elif op == 5 and out:
            start = rng.randrange(len(out))
            chunk = out[start : start + rng.randint(1, 32)]
            out[at:at] = chunk
        elif op == 6:
            other = rng.choice(seeds)
            cut = rng.randrange(len(other) + 1)
            out = out[:at] + bytearray(other[cut:])
        else:
            out = out[: rng.randrange(len(out) + 1)]
    return bytes(out)


def mutate_json(data: bytes, seeds: list[bytes], rng: random.Random) -> bytes:
    """A JSON seed with 1-3 values replaced, keys dropped or added; one in eight is mutated
    as raw bytes instead, to reach the parser's own errors."""
    if rng.randrange(8) == 0:
        return mutate_bytes(data, seeds, rng)
    try:
        tree = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return mutate_bytes(data, seeds, rng)
    for _ in range(rng.randint(1, 3)):
        tree = _mutate_tree(tree, rng)
    return json.dumps(tree).encode()


def _mutate_tree(tree, rng: random.Random):
    path = _random_path(tree, rng)
    if not path:
        return _new_value(rng, tree)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    op = rng.randrange(4)
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 1 and isinstance(parent, dict):
        parent[rng.choice(("extra", "n", "stream", "tools", "x" * 3))] = _new_value(rng, parent[key])
    elif op == 2 and isinstance(parent, list):
        parent.insert(key, _new_value(rng, parent[key]))
    else:
        parent[key] = _new_value(rng, parent[key])
    return tree


def _random_path(tree, rng: random.Random) -> list:
    path, node = [], tree
    while isinstance(node, dict | list) and node and rng.randrange(4):
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    return path


def _new_value(rng: random.Random, old):
    return copy.deepcopy(_value(rng, old))  # never share a node: the tree must stay a tree


def _value(rng: random.Random, old):
    choice = rng.randrange(4)
    if choice == 0 and isinstance(old, int | float) and not isinstance(old, bool):
        return old + rng.choice((-1, 1, 2**31, -(2**31)))
    if choice == 1 and isinstance(old, str):
        return old * rng.randint(2, 50) if rng.randrange(2) else old[: rng.randrange(len(old) + 1)]
    if choice == 2 and isinstance(old, list | dict):
        return [old, old] if rng.randrange(2) else {"nested": old}
    return rng.choice(INTERESTING_JSON)
