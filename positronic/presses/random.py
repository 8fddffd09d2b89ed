"""`random`: uniformly random selectable rows go, the reproducible baseline papers report next to
every eviction policy. Each round every live row draws a uniform value from its sequence's own
generator, seeded with `seed`, and the lowest go: a uniform sample of what the protected-rows
rule leaves, with llama.cpp's window and batch as streaming, scored and h2o."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .base import Press, Settings


@dataclass(frozen=True)
class RandomSettings(Settings):
    # starts each sequence's own generator (its sequence state): sequences of different seeds
    # score in one group
    seed: int = field(default=0, metadata={"per_sequence": True})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in 0..2**63-1, got {self.seed!r}")


class RandomPress(Press):
    """Sequence state "generator" [S, 5056] uint8: each sequence's CPU generator state. A round
    draws from copies, so a round that is not adopted draws the same again."""

    name = "random"
    Settings = RandomSettings

    def sequence_state(self):
        return {"generator": torch.Generator().manual_seed(self.settings.seed).get_state()}

    def score(self, rows, state, clock):
        rows_n = rows.shares.shape[1]
        values = torch.full((len(rows.length), rows_n), math.inf, dtype=torch.float64)
        states = []
        # The one loop over sequences in a press: each sequence draws from its own generator,
        # length[s] values, exactly what its own run draws (RandomScorer), on the CPU.
        for s, (length, saved) in enumerate(zip(rows.length.tolist(), state["generator"].cpu())):
            generator = torch.Generator()
            generator.set_state(saved.clone())  # a row of the stacked states is a view: set_state crashes on one
            values[s, :length] = torch.rand(length, generator=generator)
            states.append(generator.get_state())
        generators = torch.stack(states) if states else state["generator"].cpu().clone()
        return values.to(rows.shares.device), {"generator": generators.to(state["generator"].device)}
