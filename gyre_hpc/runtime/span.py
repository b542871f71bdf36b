"""The parts of an SGLang replica across nodes meeting over the cell's communicator, when weights
go by reference: the head asks each other part for its node's references to a bucket, tells it
when the server has read it, and tells it when the load has ended (``engines.sglang.PartPush``
draws the exchange).

Messages travel on their own tag (``SPAN_TAG``), apart from the leader's verbs and the members'
acknowledgements. A part waits at most ``wait_s`` for its head and the head for a part: a rank
that is gone fails the cell, naming whom it waited for. This module knows nothing of buckets'
contents, engines or versions' meaning.
"""

from __future__ import annotations

from typing import Any

from gyre_hpc.runtime.protocol import SPAN_TAG, Channel, ProtocolError, SpanRefs, SpanWord


class HeadSpan:
    """The head's side (``engines.sglang.HeadPeers``): ``parts`` are the cell ranks of the other
    parts, in node order."""

    def __init__(self, comm: Any, parts: list[int], wait_s: float) -> None:
        self.channel, self.parts, self.wait_s = Channel(comm, SPAN_TAG), parts, wait_s

    def references(self, version: int, bucket: int) -> list[list[str]]:
        for rank in self.parts:
            self.channel.send(SpanWord(version=version, word="ask", bucket=bucket), rank)
        out = []
        for rank in self.parts:
            _, got = self.channel.recv(self.wait_s, rank, f"references from cell rank {rank}")
            if not (isinstance(got, SpanRefs) and (got.version, got.bucket) == (version, bucket)):
                raise ProtocolError(f"cell rank {rank} answered {got!r} for bucket {bucket} of {version}")
            out.append(list(got.references))
        return out

    def read(self, version: int, bucket: int) -> None:
        for rank in self.parts:
            self.channel.send(SpanWord(version=version, word="read", bucket=bucket), rank)

    def end(self, version: int) -> None:
        """The load is over, whatever became of it (the parts stop staging and return)."""
        for rank in self.parts:
            self.channel.send(SpanWord(version=version, word="end"), rank)


class PartSpan:
    """A part's side (``engines.sglang.PartPeers``): ``head`` is its head's cell rank."""

    def __init__(self, comm: Any, head: int, wait_s: float) -> None:
        self.channel, self.head, self.wait_s = Channel(comm, SPAN_TAG), head, wait_s

    def word(self, version: int) -> tuple[str, int]:
        _, got = self.channel.recv(self.wait_s, self.head, f"a word from cell rank {self.head}")
        if not (isinstance(got, SpanWord) and got.version == version):
            raise ProtocolError(f"the replica's head said {got!r} during the load of version {version}")
        return got.word, got.bucket

    def offer(self, version: int, bucket: int, references: list[str]) -> None:
        self.channel.send(SpanRefs(version=version, bucket=bucket, references=tuple(references)), self.head)
