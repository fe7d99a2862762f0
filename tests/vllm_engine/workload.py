"""The requests the engine run sends: conversations with shared prefixes, over rounds.

Seeded and independent of the engine, so every arm of a comparison sends the same token ids:

- round 0: ``conversations`` fresh prompts in ``groups`` groups; the prompts of a group start
  with the same ``prefix_tokens`` tokens (a system prompt), then a suffix of their own;
- round r >= 1 (multi-turn): each conversation re-sends its previous prompt and the tokens the
  engine generated for it, plus a new turn, so its earlier prompt and output blocks are
  prefix-cache hits whose routed experts come back from the store;
- with ``repeat``, one last round re-sends the round-0 prompts unchanged (full hits).

Every request asks for a seeded number of output tokens in ``output_tokens`` with
``ignore_eos`` (the random model has no end-of-sequence token anyway).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    """One request of one round."""

    request_id: str
    conversation: int
    prompt: list[int]
    max_tokens: int


@dataclass
class Workload:
    """Sizes of the run; the defaults are the CI test's."""

    conversations: int = 16
    groups: int = 4
    prefix_tokens: int = 64
    suffix_tokens: tuple[int, int] = (8, 40)
    turn_tokens: tuple[int, int] = (8, 24)
    output_tokens: tuple[int, int] = (16, 32)
    rounds: int = 3
    repeat: bool = True
    vocab: int = 512
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _first: list[list[int]] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def num_rounds(self) -> int:
        return self.rounds + (1 if self.repeat else 0)

    def _tokens(self, count: int) -> list[int]:
        # Token 0 is left out: some models treat it as padding.
        return [self._rng.randrange(1, self.vocab) for _ in range(count)]

    def _max_tokens(self) -> int:
        return self._rng.randint(*self.output_tokens)

    def round(self, index: int, previous: dict[int, list[int]]) -> list[Request]:
        """The requests of round ``index``; ``previous`` maps each conversation to the prompt
        and output of its request in the round before (unused in round 0)."""
        if index == 0:
            prefixes = [self._tokens(self.prefix_tokens) for _ in range(self.groups)]
            self._first = [
                prefixes[c % self.groups] + self._tokens(self._rng.randint(*self.suffix_tokens))
                for c in range(self.conversations)
            ]
            prompts = self._first
        elif index < self.rounds:
            prompts = [
                previous[c] + self._tokens(self._rng.randint(*self.turn_tokens))
                for c in range(self.conversations)
            ]
        else:
            prompts = self._first
        return [
            Request(f"r{index}-c{c}", c, list(prompt), self._max_tokens())
            for c, prompt in enumerate(prompts)
        ]
