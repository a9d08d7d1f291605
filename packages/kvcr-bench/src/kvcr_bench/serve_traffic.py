"""The traffic of `kvcr bench serve`: multi-turn conversations with long shared prefixes,
written as traces for vLLM's own benchmark client (`vllm bench serve --dataset-name
timed_trace`, the Mooncake trace format: input_length, output_length, hash_ids, timestamp).

vLLM 0.32's client has no multi-turn dataset (its prefix-repetition one shares one prefix
between unrelated prompts), but its trace replay expands each hash id into one fixed run of
`chunk_tokens` token ids (the same id, the same tokens, within one client process), so a
trace describes prefixes exactly. Turn t of a user = the system prompt all users share + the
user's document + (question, answer) for every earlier turn + the next question: each
turn's prompt begins with every token of the user's previous turn.

Steady state, not a synchronized start: `seats` users talk at once; each seat runs one
conversation after another, and the seats start out of phase (seat s at turn s*T/seats), so
new conversations (cold prompts) are spread over the run. The requests go round by round
(every seat's next turn, then the next round): a seat's consecutive turns are `seats`
requests apart, so with `seats` > concurrency the client sends a turn after the previous
one ended (it sends in file order). Round 0 is the warm-up (every seat's first prompt,
cold, all at once); the measured rounds follow. A user's turn t goes to engine
(user + t) % 2: consecutive turns alternate between two servers (SplitProxy routes by the
client's request ids). Pure functions except `write_trace`.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    """How big the conversations are, in chunks of `chunk_tokens` tokens."""

    turns: int
    system_chunks: int
    document_chunks: int
    question_chunks: int
    answer_chunks: int
    output_tokens: int
    chunk_tokens: int = 32


@dataclass(frozen=True)
class Turn:
    user: int
    turn: int
    engine: int
    hash_ids: tuple[int, ...]


def schedule(seats: int, rounds: int, shape: Shape, first_id: int) -> list[list[Turn]]:
    """Round 0 (the warm-up) and `rounds` measured rounds of one turn per seat. The system
    prompt is hash ids 0.. (the same for every call); the rest are new ids from `first_id`.
    A seat that starts mid-conversation starts with the earlier turns in its first prompt."""
    system = tuple(range(shape.system_chunks))
    fresh = itertools.count(max(first_id, shape.system_chunks))

    def chunks(n: int) -> tuple[int, ...]:
        return tuple(next(fresh) for _ in range(n))

    history: dict[int, tuple[int, ...]] = {}
    out = []
    for r in range(rounds + 1):
        row = []
        for seat in range(seats):
            position = seat * shape.turns // seats + r
            user = seat + position // shape.turns * seats
            turn = position % shape.turns
            if user not in history:
                history[user] = system + chunks(shape.document_chunks) + chunks(
                    turn * (shape.question_chunks + shape.answer_chunks))
            history[user] += chunks(shape.question_chunks)
            row.append(Turn(user, turn, (user + turn) % 2, history[user]))
            history[user] += chunks(shape.answer_chunks)
        out.append(row)
    return out


def write_trace(turns: list[Turn], shape: Shape, path: Path) -> Path:
    """The JSONL file `--dataset-name timed_trace` reads (`--timed-trace-chunk-hash-size`
    = `shape.chunk_tokens`; replayed with `--no-self-timed`, so the timestamps only order)."""
    path.write_text("".join(json.dumps({
        "timestamp": i, "input_length": len(t.hash_ids) * shape.chunk_tokens,
        "output_length": shape.output_tokens, "hash_ids": list(t.hash_ids)}) + "\n"
        for i, t in enumerate(turns)))
    return path
