"""What an engine that shares its GPUs with its cell's trainer holds, and the server verbs that
move it from one state to the next: one table, the only place these sequences are written.

```
              train                          train (memory saver)
   SERVING ──────────────▶ PAUSED    SERVING ─────────────────────▶ RELEASED
      ▲  pause_generation    │          ▲  pause_generation,           │
      │                      │          │  release_memory_occupation   │
      └──────── sample ──────┘          └──────────── sample ──────────┘
            continue_generation              resume_memory_occupation,
                                             continue_generation

   died:   a fresh one is started at once, unless the old one was RELEASED: its cell trains on
           the GPU, and a server sizes its KV pool by the memory free when it starts, so it
           would keep a pool sized around the trainer for good. Then it is DOWN until the cell
           samples, and starts then (sample from DOWN: START).
   restart (a fresh server serves, holding its memory): it loads the newest weights, then is
           taken back to the state the old one was in (a cell that trains gets its memory back
           released, not merely paused)
   load:   SERVING or PAUSED; into RELEASED memory it is refused (a released server keeps no
           weights to overwrite: resume first)
```

Pure: it names verbs, it does not send them (``engines.hosted.SGLangHost`` does). It knows
nothing of roles, versions or the proxy; that the proxy drained a server before ``train`` is
the cell's promise (SGLang kills requests whose memory is released under them).
"""

from __future__ import annotations

from enum import Enum


class State(Enum):
    SERVING = "serving"
    PAUSED = "paused"
    """Not generating; weights and KV cache still on the GPU."""
    RELEASED = "released"
    """Not generating; weights and KV cache handed back (the memory saver's release)."""
    DOWN = "down"
    """Dead while released: started again when its cell samples, with the GPU its own."""


PAUSE, CONTINUE = "pause_generation", "continue_generation"
RELEASE, RESUME = "release_memory_occupation", "resume_memory_occupation"
LOAD = "load"
START = "start"
"""Not a server verb: the host starts a fresh server, which loads the newest weights and serves."""
TO_SERVING = {
    State.SERVING: (),
    State.PAUSED: (CONTINUE,),
    State.RELEASED: (RESUME, CONTINUE),
    State.DOWN: (START,),
}


class VerbNotAllowed(RuntimeError):
    """A verb the state does not allow (a load into released memory)."""


def step(state: State, verb: str, saver: bool) -> tuple[State, tuple[str, ...]]:
    """The state ``verb`` leads to from ``state``, and the server verbs that take it there.
    ``verb``: ``train`` (the trainer needs the GPU), ``sample``, ``load``, ``died`` (its process
    is gone: ``START`` now, or DOWN until the cell samples) or ``restarted`` (a fresh server that
    serves; ``state`` is the one the dead server was in). ``saver``: the server releases memory
    (``engine.enable_memory_saver`` on a GPU)."""
    if verb == "train":
        if state != State.SERVING:
            return state, ()
        return (State.RELEASED, (PAUSE, RELEASE)) if saver else (State.PAUSED, (PAUSE,))
    if verb == "sample":
        return State.SERVING, TO_SERVING[state]
    if verb == "load":
        if state in (State.RELEASED, State.DOWN):
            raise VerbNotAllowed(f"a load into a {state.value} server: the cell must sample first")
        return state, (LOAD,)
    if verb == "died":
        return (State.DOWN, ()) if state in (State.RELEASED, State.DOWN) else (state, (START,))
    if verb == "restarted":
        back = step(State.SERVING, "train", saver) if state != State.SERVING else (State.SERVING, ())
        return back[0], (LOAD, *back[1])
    raise ValueError(f"unknown verb {verb!r}; valid: train, sample, load, died, restarted")
