"""The control protocol between the controller and the cells: typed messages over MPI.

```
 controller (rank 0)                         cell leader            cell members
   │                                          │◀── EnginesUp ──────────┤  members hosting a replica
   │◀──────────────── Hello ──────────────────┤                        │
   ├──────────────── TakeRole ───────────────▶├── TakeRole ───────────▶│
   │◀─────────────── RoleTaken ───────────────┤◀── RoleTaken ──────────┤
   │◀─────────────── Heartbeat (every heartbeat_s) ─┤                   │
   │◀─────────────── EngineRestart (its server came back) ─┤            │
   ├──────────────── LoadWeights(v) ─────────▶├── LoadWeights(v) ─────▶│  every replica pulls
   │◀─────────────── Loaded ──────────────────┤◀── Loaded ─────────────┤  snapshot v from the core
   ├──────────────── TrainStep(v, queue) ────▶│  claim micro-steps until the queue is empty
   │◀─────────────── TrainDone(claimed) ──────┤
   ├──────────────── ApplyStep ──────────────▶│  core only: pull, sum, step, publish v+1
   │◀─────────────── StepApplied(v+1) ────────┤
   ├──────────────── Goodbye ────────────────▶├── Goodbye ────────────▶│
                                              ├── Mirror(verb) ───────▶│  trainer verbs of a replica
                                                                          spread over the cell
```

Messages are frozen dataclasses sent with mpi4py's pickled ``send`` on one tag. Bulk data —
weights and gradients — never travels here: it moves one-sided through ``transport``; only a
step's micro-step queue (token ids, masks, log-probs) rides in ``TrainStep``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from gyre_hpc.engines.pushed import Pushed
from gyre_hpc.observability.events import EngineRestart, Hello
from gyre_hpc.scheduler.fleet import ProtocolError, StepApplied, TrainDone
from gyre_hpc.scheduler.policy import Role
from gyre_hpc.trajectory.sequences import StepQueue

CONTROL_TAG = 17
STALE_TAG = 18
"""A member's ``EngineStale`` to its leader: apart from the acknowledgements the leader waits for."""
SPAN_TAG = 19
"""The parts of an engine replica across nodes, a push by reference bucket by bucket (``runtime.span``)."""
POLL_INTERVAL_S = 0.002  # between probes: ranks outnumber cores on a laptop, so never spin


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStale:
    """Member → leader: its engine restarted in a cell that streams weights from its slices and
    waits, paused, for ``version``; the leader streams it in between messages."""

    rank: int
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineVerb:
    """Leader → a member hosting an engine replica: ``pause`` or ``resume`` it; the member
    answers with the same message once done (a role switch's engine half)."""

    verb: str
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EnginesUp:
    """A cell member's engine parts are up: the URLs of those that serve (head parts), by replica."""

    rank: int
    addresses: dict[int, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class TakeRole:
    cell: int
    role: Role
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleTaken:
    cell: int
    role: Role
    seq: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    cell: int
    role: Role
    sent: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodbye:
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadWeights:
    """Load snapshot ``version`` into the cell's engine (pulled from the core)."""

    cell: int
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Loaded:
    cell: int
    version: int
    seconds: float
    pushed: Pushed = Pushed()
    """What the load moved into the cell's replicas (or this member's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SpanWord:
    """The head of an engine replica across nodes → its other parts: ``ask`` for their
    references to ``bucket``, the server ``read`` it, or the load's ``end``."""

    version: int
    word: str
    bucket: int = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class SpanRefs:
    """A part → its head: its node's references to its copy of ``bucket``, one per TP rank."""

    version: int
    bucket: int
    references: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainStep:
    """Train on the step's micro-steps, claimed from the shared counter, from snapshot ``version``.

    With ``closed`` False more micro-steps follow (``MicroSteps``) until ``CloseQueue``."""

    step: int
    version: int
    queue: StepQueue
    closed: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroSteps:
    """More micro-steps of an open step's queue (appended in order)."""

    step: int
    items: StepQueue


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseQueue:
    """The step's queue is complete: ``total`` micro-steps. ``stop``: the step ends now — finish
    the micro-step in hand and claim no more (the rest is carried into the next step)."""

    step: int
    total: int
    stop: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyStep:
    """Core only: sum the gradients of ``contributors`` (ranks) into its own, step, publish."""

    step: int
    contributors: list[int]
    num_runs: int
    checkpoint: bool
    state: dict  # extra resume state stored with the checkpoint


@dataclass(frozen=True, slots=True, kw_only=True)
class Mirror:
    """Inside a cell, leader to members: call trainer ``verb`` with ``args`` as the leader does
    (``runtime.replica``)."""

    verb: str
    args: tuple = ()


Message = (
    Hello
    | SpanWord
    | SpanRefs
    | EngineRestart
    | EnginesUp
    | EngineVerb
    | TakeRole
    | RoleTaken
    | Heartbeat
    | Goodbye
    | LoadWeights
    | Loaded
    | TrainStep
    | MicroSteps
    | CloseQueue
    | TrainDone
    | ApplyStep
    | StepApplied
    | Mirror
)
MESSAGE_TYPES = (
    Hello,
    SpanWord,
    SpanRefs,
    EngineRestart,
    EngineStale,
    EnginesUp,
    EngineVerb,
    TakeRole,
    RoleTaken,
    Heartbeat,
    Goodbye,
    LoadWeights,
    Loaded,
    TrainStep,
    MicroSteps,
    CloseQueue,
    TrainDone,
    ApplyStep,
    StepApplied,
    Mirror,
)


class Channel:
    """Typed control messages on one communicator; neither sending nor receiving blocks.

    Receiving polls with short sleeps instead of blocking in MPI, so signal handlers run and
    timeouts are honoured.
    """

    def __init__(self, comm: Any, tag: int = CONTROL_TAG) -> None:
        self.comm, self.tag = comm, tag
        self._sending: list[Any] = []
        self._lock = threading.Lock()
        """Sends may come from two threads (a leader's heartbeats while a handler works: MPI is
        initialised with ``MPI_THREAD_MULTIPLE``)."""

    def send(self, message: Message, dest: int) -> None:
        """Returns at once: a large message (micro-steps) to a cell busy training would otherwise
        hold the sender until the cell next polls. MPI keeps the order of messages per peer."""
        with self._lock:
            self._sending.append(self.comm.isend(message, dest=dest, tag=self.tag))
            self._sending = [r for r in self._sending if not r.Test()]

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for sent messages to be taken; how many were not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                self._sending = [r for r in self._sending if not r.Test()]
                if not self._sending:
                    return 0
            time.sleep(POLL_INTERVAL_S)
        with self._lock:
            return len(self._sending)

    def poll(self, source: int | None = None) -> tuple[int, Message] | None:
        """One message if one is waiting, else None."""
        from mpi4py import MPI

        status = MPI.Status()
        src = MPI.ANY_SOURCE if source is None else source
        if not self.comm.iprobe(source=src, tag=self.tag, status=status):
            return None
        message = self.comm.recv(source=status.Get_source(), tag=self.tag)
        if not isinstance(message, MESSAGE_TYPES):
            raise ProtocolError(f"rank {status.Get_source()} sent {type(message).__name__}, not a message")
        return status.Get_source(), message

    def recv(
        self, timeout: float | None, source: int | None = None, what: str = "a message"
    ) -> tuple[int, Message]:
        """The next message, or ProtocolError after ``timeout`` seconds (None: wait for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (got := self.poll(source)) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise ProtocolError(f"no {what} within {timeout:g} s")
            time.sleep(POLL_INTERVAL_S)
        return got


def wait_barrier(comm: Any, timeout: float) -> None:
    """A barrier that gives up instead of hanging when a peer is gone."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise ProtocolError(f"barrier not reached by every rank within {timeout:g} s")
        time.sleep(POLL_INTERVAL_S)
