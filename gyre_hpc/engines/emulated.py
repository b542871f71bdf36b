"""The emulated engine: the embedded engine's API and scheduling, with decoding replaced by a clock.

```
 submit ─▶ waiting ──admit: plan the reply (seeded)──▶ running ──┐ every tick (decode_s):
                                                        ▲         │ each running sequence
                                                        └─────────┘ gains its next planned token
```

Used to run many cells on few CPU cores (``gyre-hpc bench modes`` with emulated GPUs): the
control plane, proxy, TITO, trajectories, transport and micro-step queue all run for real; only
the model's compute becomes a calibrated delay. Every running sequence gains one token per tick
whatever the batch, as on a GPU that is not saturated.

The reply is planned from the request's sampling seed: a log-normal number of filler tokens
(capped by ``max_new_tokens``, the engine's timeout) followed by a ``finish`` tool call, so one
agent call ends its execution. A call continued on another engine after a drain (its input now
ends with the tokens already generated) resumes the same plan, so a migration does not change
how long the reply is. Weights load as usual (they travel through the transport) but are never
used. The engine knows nothing about tasks or rewards.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from gyre_hpc.engines.embedded import Engine, Sequence

FINISH_CALL = '<tool_call>\n{"name": "finish", "arguments": {"summary": "done"}}\n</tool_call>'


def planned_tokens(seed: int | None, median: float, sigma: float) -> int:
    """Reply length for a sampling seed: log-normal around ``median``, at least 1 (the engine cuts
    it at the call's ``max_new_tokens``)."""
    rng = random.Random(seed)
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))


class EmulatedEngine(Engine):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_running: int = 32,
        decode_s: float = 0.02,
        tokens_median: float = 100.0,
        tokens_sigma: float = 0.6,
    ) -> None:
        super().__init__(model_dir, max_running=max_running, cache_tokens=0)
        self.decode_s, self.tokens_median, self.tokens_sigma = decode_s, tokens_median, tokens_sigma
        self.filler = self.tokenizer.encode(" work")[:1]
        self.tail = self.tokenizer.encode(FINISH_CALL) + [self.config.eos_ids[0]]
        self.plans: dict[int, list[int]] = {}  # id(Sequence) -> the tokens it still has to emit
        self._tick = 0.0

    def plan(self, seq: Sequence) -> list[int]:
        """The whole reply, and what of it a continued call (input ending in it) still owes."""
        n = planned_tokens(seq.params.sampling_seed, self.tokens_median, self.tokens_sigma)
        reply = (self.filler * max(0, n - len(self.tail)) + self.tail)[-n:]
        return reply[_resumed_at(seq.input_ids, reply) :]

    def step(self) -> bool:
        busy = super().step()  # admission, retraction and pausing as in the embedded engine
        if busy:
            self._sleep_to_next_tick()  # outside the lock: submits and aborts go on meanwhile
        return busy

    def _prefill(self, seq: Sequence) -> None:
        """No compute: plan the reply (a retracted call keeps the plan it had)."""
        if id(seq) not in self.plans:
            self.plans[id(seq)] = self.plan(seq)
            self.stats["prompt_tokens"] += len(seq.input_ids)

    def _decode(self, batch: list[Sequence]) -> None:
        for seq in batch:
            self._emit_planned(seq)
        self.stats["decode_steps"] += 1

    def _sleep_to_next_tick(self) -> None:
        now = time.monotonic()
        self._tick = (
            self._tick + self.decode_s if now - self._tick < 2 * self.decode_s else now + self.decode_s
        )
        time.sleep(max(0.0, self._tick - time.monotonic()))

    def _emit_planned(self, seq: Sequence) -> None:
        plan = self.plans[id(seq)]
        token = plan.pop(0)
        seq.output_ids.append(token)
        seq.logprobs.append(-1.0)
        self.stats["generated_tokens"] += 1
        if token in self.config.eos_ids and not seq.params.ignore_eos:
            self._finish(seq, {"type": "stop", "matched": token})
        elif not plan or len(seq.output_ids) >= seq.params.max_new_tokens:
            self._finish(seq, {"type": "length", "length": len(seq.output_ids)})
        elif seq.on_token:
            seq.on_token(seq)

    def _finish(self, seq: Sequence, reason: dict) -> None:
        self.plans.pop(id(seq), None)
        super()._finish(seq, reason)


def _resumed_at(input_ids: list[int], reply: list[int]) -> int:
    """How much of ``reply`` the input already ends with (a call continued after a drain)."""
    for k in range(min(len(reply), len(input_ids)), 0, -1):
        if input_ids[-k:] == reply[:k]:
            return k
    return 0
