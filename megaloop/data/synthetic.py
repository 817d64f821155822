"""Built-in corpora on which extra loops measurably help, generated from (seed, index) alone.

`addition`: fixed-width sums written most-significant digit first, `0473+0968=01441`. The first
answer digits depend on the whole carry chain, which a shallow stack resolves only with more
loops; fixed widths let attention find the operand digits by position, so a tiny model learns
it in a minute on a CPU.

`chase`: pointer chasing: a random cyclic permutation f of 0..5, then one query per hop count
h = 1..depth, each answered by f^h(start) as a digit (CHASE_ENTRY and CHASE_QUERY say how they
are written), one episode a window at seq_len 15 for depth 4. An h-hop answer is h lookups by
content, while the table and query tokens are random and no lookup helps them. Measured at
d=128, one layer a loop, 2,000 steps of 128 one-episode windows: every answer is right at loop
1 (CE < 0.02), so at that size one loop holds all four hops (issue 41's notes).

`lookup`: chains of single-letter variables in shuffled order and a query for the end of one,
`c=b;x=7;a=4;b=a;y=x;?c=4`; each hop is another content-based lookup (harder: it needs
induction-like attention, so it takes far longer to learn).

Every sample is a pure function of (seed, index): no files, and resuming or re-sharding is exact.
Validation samples come from a fixed stream of their own (VALID_SEED), the same whatever
train.seed is and disjoint from every training stream; it has no end, so there is no
"whole validation split" to evaluate.
"""

from __future__ import annotations

import string

import numpy as np

from megaloop.data.batches import IndexableData


def addition(rng: np.random.Generator, digits: int) -> str:
    a, b = (int(rng.integers(0, 10**digits)) for _ in range(2))
    return f"{a:0{digits}d}+{b:0{digits}d}={a + b:0{digits + 1}d}\n"


def lookup(rng: np.random.Generator, max_hops: int, chains: int = 2) -> str:
    names = rng.permutation(list(string.ascii_lowercase))
    statements, ends, values = [], [], []
    used = 0
    for _ in range(chains):
        hops = int(rng.integers(1, max_hops + 1))
        chain = names[used : used + hops]
        used += hops
        value = str(rng.integers(0, 10))
        statements.append(f"{chain[0]}={value}")
        statements += [f"{b}={a}" for a, b in zip(chain[:-1], chain[1:])]
        ends.append(chain[-1])
        values.append(value)
    order = rng.permutation(len(statements))
    asked = int(rng.integers(0, chains))
    return ";".join(statements[i] for i in order) + f";?{ends[asked]}={values[asked]}\n"


CHASE_TABLE, CHASE_MOST_HOPS = 6, 5
CHASE_ENTRY, CHASE_QUERY = 58, 97
"""One byte per table entry i→j, CHASE_ENTRY + 6i + j (':' .. ']'), and per query of h hops from
s, CHASE_QUERY + 6(h−1) + s ('a' ..): a hop is one lookup by content (the entry whose i is the
current value holds the next value), with no token to find first."""


def chase(rng: np.random.Generator, hops: int) -> str:
    # one cycle through all values: no iterate up to CHASE_TABLE - 1 hops is the start itself,
    # so no answer can be guessed from the query without the lookups
    cycle = rng.permutation(CHASE_TABLE)
    table = np.empty(CHASE_TABLE, dtype=np.int64)
    table[cycle] = np.roll(cycle, -1)
    entries = [chr(CHASE_ENTRY + CHASE_TABLE * i + int(table[i])) for i in range(CHASE_TABLE)]
    queries = []
    for h in range(1, hops + 1):
        start = value = int(rng.integers(0, CHASE_TABLE))
        for _ in range(h):
            value = int(table[value])
        queries.append(f"{chr(CHASE_QUERY + CHASE_TABLE * (h - 1) + start)}{value}")
    return "".join(entries[i] for i in rng.permutation(CHASE_TABLE)) + "".join(queries) + "\n"


TASKS = {"addition": addition, "lookup": lookup, "chase": chase}
ANSWER_OPENS = {"addition": "=", "lookup": "?"}
"""The character after which an episode's asked-for answer follows."""
VALID_SEED = 1_000_003
"""Validation sample i is drawn from [VALID_SEED, i, 1]: the third, non-zero word keeps it apart
from every training key [seed, index] (which numpy reads as [seed, index, 0])."""


def sample(
    task: str, seed: int, index: int, length: int, depth: int, split: str = "train"
) -> np.ndarray:
    """`length` byte tokens of back-to-back episodes, determined by (task, seed, index), or by
    (task, index) alone for the validation split."""
    rng = np.random.default_rng([seed, index] if split == "train" else [VALID_SEED, index, 1])
    episodes = []
    while sum(map(len, episodes)) < length:
        episodes.append(TASKS[task](rng, depth))
    return np.frombuffer("".join(episodes)[:length].encode("ascii"), dtype=np.uint8).astype(
        np.int64
    )


def answer_mask(tokens: np.ndarray, task: str) -> np.ndarray:
    """True at positions whose next token is part of an answer (what the episode asks for)."""
    return answer_kinds(tokens, task) > 0


def answer_kinds(tokens: np.ndarray, task: str) -> np.ndarray:
    """Per position, what its next token is: 0 not an answer, else which answer of its episode
    (1-based; for `chase` the hop count it asks, for the others 1)."""
    kinds = np.zeros(len(tokens), dtype=np.int64)
    if task == "chase":
        query = tokens[:-1] - CHASE_QUERY
        asks = (query >= 0) & (query < CHASE_TABLE * CHASE_MOST_HOPS)
        kinds[:-1][asks] = query[asks] // CHASE_TABLE + 1
        return kinds
    text = bytes(tokens.astype(np.uint8)).decode("ascii")
    opens = ANSWER_OPENS[task]
    pos = text.find(opens)
    while pos != -1:
        eq = text.find("=", pos)
        end = text.find("\n", eq)
        if eq == -1 or end == -1:
            break
        kinds[eq : end - 1] = 1  # predicting tokens eq+1 .. end-1, the answer characters
        pos = text.find(opens, end)
    return kinds


class SyntheticDataset(IndexableData):
    """A built-in corpus as indexable data; the valid split is the fixed VALID_SEED stream,
    without end: validation takes a stated number of samples (train.eval_batches)."""

    def __init__(self, task: str, seed: int, seq_len: int, depth: int, tokenizer):
        self.task, self.seed, self.seq_len, self.depth = task, seed, seq_len, depth
        self.tokenizer = tokenizer

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        return sample(self.task, self.seed, index, self.seq_len + 1, self.depth, split)
