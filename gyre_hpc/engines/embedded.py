"""The embedded engine: a model of any supported family (transformers' own) served on CPU (or one
GPU) with the behaviour of SGLang that the proxy and the scheduler rely on.

```
 submit ─▶ waiting ──admit: prefix-cache lookup, prefill the rest──▶ running ──┐
                ▲                                                      │ one batched decode step
                └────────────── retract (pause) ◀──────────────────────┤ for every running sequence
                          finished / aborted ◀─────────────────────────┘ (continuous batching)
```

- Continuous batching: sequences join and leave the decode batch between steps.
- Prefix cache: the keys/values of finished sequences are kept (LRU, bounded in tokens);
  a new request reuses the longest cached prefix — multi-turn agents resend their whole
  context, so most of it is cached — and reports it as ``cached_tokens``.
- Log-probs are those of the distribution each token was sampled from.
- A mixture-of-experts model's routed experts are captured for every position it forwards
  (``models.routing``), kept with the keys/values (prefix cache, KV migration) and returned as
  SGLang returns them (``routed_experts``: base64 int32 [positions, layers, top-k] of positions
  ``routed_experts_start_len`` to the last but one), so a prefix-cached call's are complete.
- Weights load from a checkpoint directory or from a flat buffer with a version number.

The engine works on token ids; its tokenizer is used only to return ``text`` and match stop
strings. It knows nothing about chats, runs or roles.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from gyre_hpc.engines import kv_transfer
from gyre_hpc.engines.sampling import BadRequest, SamplingParams, sample
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.flat import FlatLayout, whole
from gyre_hpc.models.routing import routed
from gyre_hpc.models.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[[dict[str, Any]], None]
    on_token: Callable[[Sequence], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    keys: torch.Tensor | None = None  # [layers, kv_heads, capacity, head_dim]
    values: torch.Tensor | None = None
    length: int = 0  # positions whose keys/values are held
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    generator: torch.Generator | None = None
    started: float = field(default_factory=time.monotonic)
    extra_key: str = ""
    """The request's cache key (SGLang's ``extra_key``): it reuses only prefixes of the same key."""
    kv_version: str | None = None
    """The weight version its keys/values were computed at (set at prefill)."""
    routes: list[torch.Tensor] = field(default_factory=list)
    """A MoE model's routed experts of the positions it has forwarded, in pieces [n, layers, k]."""
    routes_from: int | None = None
    """The first position whose routes the response returns; None: none asked for."""

    @property
    def tokens(self) -> list[int]:
        return self.input_ids + self.output_ids


@dataclass
class _CacheEntry:
    tokens: np.ndarray
    keys: torch.Tensor  # [layers, kv_heads, len, head_dim]
    values: torch.Tensor
    used: float
    key: tuple[str, str] = ("", "")
    """(the request's ``extra_key``, the weight version the keys/values were computed at)"""
    routes: torch.Tensor | None = None
    """A MoE model's routed experts of the same positions."""


class PrefixCache:
    """Keys/values of earlier sequences, found by longest common token prefix (LRU, bounded)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.entries: list[_CacheEntry] = []

    def lookup(
        self, tokens: list[int], key: tuple[str, str] = ("", ""), routes: bool = False
    ) -> tuple[_CacheEntry | None, int]:
        """The longest cached prefix of ``tokens`` under ``key`` (no entry of another key matches;
        with ``routes`` none without them)."""
        arr = np.asarray(tokens, dtype=np.int32)
        best, best_len = None, 0
        for e in self.entries:
            if e.key != key or (routes and e.routes is None):
                continue
            n = min(len(arr), len(e.tokens))
            if n <= best_len:
                continue
            neq = np.flatnonzero(arr[:n] != e.tokens[:n])
            m = n if len(neq) == 0 else int(neq[0])
            if m > best_len:
                best, best_len = e, m
        if best is not None:
            best.used = time.monotonic()
        return best, best_len

    def insert(
        self,
        tokens: list[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        key: tuple[str, str] = ("", ""),
        routes: torch.Tensor | None = None,
    ) -> None:
        if not tokens or self.max_tokens <= 0:
            return
        arr = np.asarray(tokens, dtype=np.int32)
        # An entry of the same key this one extends is redundant.
        self.entries = [
            e
            for e in self.entries
            if not (
                e.key == key and len(e.tokens) <= len(arr) and np.array_equal(e.tokens, arr[: len(e.tokens)])
            )
        ]
        self.entries.append(_CacheEntry(arr, keys.clone(), values.clone(), time.monotonic(), key, routes))
        while sum(len(e.tokens) for e in self.entries) > self.max_tokens and len(self.entries) > 1:
            self.entries.remove(min(self.entries, key=lambda e: e.used))

    def clear(self) -> None:
        self.entries.clear()

    @property
    def num_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_running: int = 32,
        cache_tokens: int = 1 << 20,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.model = CausalLM.from_pretrained(self.model_dir, dtype).to(self.device)
        self.dtype = dtype
        self.config = self.model.config
        self.moe = bool(self.config.num_experts)
        self.flat_layout = FlatLayout.of(self.config)
        self.tokenizer = ChatTokenizer(self.model_dir)
        self.max_running = max_running
        self.cache = PrefixCache(cache_tokens)
        self.pinned: dict[str, bytes] = {}  # exported KV, held until the destination acknowledges
        self.weight_version = "default"
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.paused = False
        self.lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "decode_steps": 0}

    # ---- requests ---------------------------------------------------------------------------

    def submit(
        self,
        input_ids: list[int],
        params: SamplingParams,
        on_done: Callable[[dict[str, Any]], None],
        rid: str | None = None,
        on_token: Callable[[Sequence], None] | None = None,
        extra_key: str = "",
        routes_from: int | None = None,
    ) -> Sequence:
        """``routes_from``: return the routed experts of positions from there (SGLang's
        ``routed_experts_start_len``); a dense model has none to return."""
        self.check(input_ids, params)
        if routes_from is not None and not 0 <= routes_from <= len(input_ids):
            raise BadRequest(f"routed_experts_start_len must be in [0, {len(input_ids)}]")
        seq = Sequence(
            rid or uuid.uuid4().hex,
            list(input_ids),
            params,
            on_done,
            on_token,
            extra_key=extra_key,
            routes_from=routes_from if self.moe else None,
        )
        if params.sampling_seed is not None:
            seq.generator = torch.Generator().manual_seed(params.sampling_seed)
        with self.lock:
            self.waiting.append(seq)
        self._wake.set()
        return seq

    def check(self, input_ids: list[int], params: SamplingParams) -> None:
        """Refuse, at once, what this engine cannot serve: ids outside the vocabulary, or a prompt
        that with its new tokens would not fit the model's context (it would only grow memory)."""
        if not input_ids:
            raise BadRequest("input_ids is empty")
        vocab, context = self.config.vocab_size, self.config.max_position_embeddings
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in input_ids):
            raise BadRequest(f"input_ids must be token ids in [0, {vocab})")
        if len(input_ids) + params.max_new_tokens > context:
            raise BadRequest(
                f"a prompt of {len(input_ids)} tokens + max_new_tokens {params.max_new_tokens} does not "
                f"fit the model's context of {context} tokens"
            )

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        with self.lock:
            victims = [s for s in self.waiting + self.running if abort_all or s.rid == rid]
            for s in victims:
                self._finish(s, {"type": "abort", "message": "aborted by request"})
        return len(victims)

    def pause(self, mode: str = "abort") -> None:
        """Stop generating: ``abort`` in-flight requests, ``retract`` them to the queue, or ``in_place``."""
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode = {mode!r} is not valid; valid: abort, retract, in_place")
        with self.lock:
            self.paused = True
            if mode == "abort":
                self.abort(abort_all=True)
            elif mode == "retract":
                for s in self.running:
                    self._release(s)
                self.waiting[:0] = self.running
                self.running = []

    def resume(self) -> None:
        with self.lock:
            self.paused = False
        self._wake.set()

    def flush_cache(self) -> None:
        with self.lock:
            self.cache.clear()

    # ---- KV migration -----------------------------------------------------------------------

    def export_kv(self, rid: str) -> tuple[str, int] | None:
        """Pin the keys/values of in-flight request ``rid``; (handle, tokens) or None if unknown."""
        with self.lock:
            seq = next((s for s in self.running if s.rid == rid), None)
            if seq is None or seq.keys is None or seq.values is None:
                return None
            handle = uuid.uuid4().hex
            n = seq.length
            keys, values = seq.keys[:, :, :n].cpu(), seq.values[:, :, :n].cpu()
            self.pinned[handle] = kv_transfer.pack(seq.tokens[:n], keys, values, self._routes(seq))
            return handle, n

    def import_kv(self, data: bytes, extra_key: str = "") -> int:
        """Keys/values moved from another engine go into the prefix cache, under ``extra_key`` and
        the version served now (the router moves them only between engines of one version);
        returns their tokens."""
        tokens, keys, values, routes = kv_transfer.unpack(data)
        with self.lock:
            at = keys.to(self.device, self.dtype), values.to(self.device, self.dtype)
            self.cache.insert(tokens, *at, (extra_key, self.weight_version), routes)
        return len(tokens)

    def release_kv(self, handle: str) -> None:
        with self.lock:
            self.pinned.pop(handle, None)

    # ---- weights ----------------------------------------------------------------------------

    def load_weights_from_disk(self, model_path: str | Path, version: str) -> None:
        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            state.update(load_file(f))
        if not state:
            raise BadRequest(f"no *.safetensors in {model_path}")
        with self.lock:
            if self.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or [m for m in missing if m != "lm_head.weight"]:
                raise BadRequest(f"{model_path} does not fit this model")
            self.cache.clear()
            self.weight_version = version

    def load_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> int:
        """Weights as whole Hugging Face tensors, copied in as they arrive (generation waits
        meanwhile); the elements loaded. Every tensor of the model must come."""
        params = dict(self.model.named_parameters())
        loaded: dict[str, int] = {}  # elements of each parameter loaded (whole, or a piece at a time)
        elements = 0
        with self.lock, torch.no_grad():
            for name, t in tensors:
                base, index = whole(name)
                target = params.get(base)
                if target is not None and index is not None and 0 <= index < target.shape[0]:
                    target = target[index]  # one routed expert of a layer's fused tensor
                if target is None or target.shape != t.shape:
                    raise BadRequest(f"{name} {tuple(t.shape)} does not fit this model")
                target.copy_(t)
                loaded[base] = loaded.get(base, 0) + t.numel()
                elements += t.numel()
            slots = self.flat_layout.slots
            if missing := [n for n, (_, shape) in slots.items() if loaded.get(n) != shape.numel()]:
                raise BadRequest(f"a load without all of {sorted(missing)[:3]}")
            self.cache.clear()
            self.weight_version = version
        return elements

    def load_flat(self, buffer: torch.Tensor, version: str) -> None:
        """Weights from one flat buffer in the shared layout (``models.flat``)."""
        with self.lock:
            try:
                self.flat_layout.load(self.model, buffer)
            except ValueError as err:
                raise BadRequest(str(err)) from None
            self.cache.clear()
            self.weight_version = version

    # ---- the loop ---------------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop:
            try:
                busy = self.step()
            except Exception as err:  # a bug must not strand every waiting request
                log.exception("engine step failed")
                with self.lock:
                    for s in self.running + self.waiting:
                        self._finish(s, {"type": "abort", "message": f"engine error: {err}"})
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    @torch.no_grad()
    def step(self) -> bool:
        """Admit waiting sequences, then one decode step for all running ones. False when idle."""
        with self.lock:
            if self.paused:
                return False
            while self.waiting and len(self.running) < self.max_running:
                seq = self.waiting.pop(0)
                self._prefill(seq)
                if seq.finish_reason is None:
                    self.running.append(seq)
            if not self.running:
                return False
            # A copy: a sequence that finishes during the step leaves ``self.running`` at once.
            self._decode(list(self.running))
            self.running = [s for s in self.running if s.finish_reason is None]
            return True

    def _prefill(self, seq: Sequence) -> None:
        tokens = seq.tokens  # a retracted sequence resumes with what it had generated
        seq.kv_version = self.weight_version
        entry, hit = self.cache.lookup(tokens, (seq.extra_key, seq.kv_version), routes=self.moe)
        hit = min(hit, len(tokens) - 1)  # the last token must run to give the next logits
        c = self.config
        cap = len(tokens) + min(seq.params.max_new_tokens, 256) + 1  # grows by doubling when needed
        seq.keys = torch.zeros(
            c.num_hidden_layers, c.num_key_value_heads, cap, c.head_dim, dtype=self.dtype, device=self.device
        )
        seq.values = torch.zeros_like(seq.keys)
        past = None
        if entry is not None and hit > 0:
            seq.keys[:, :, :hit] = entry.keys[:, :, :hit]
            seq.values[:, :, :hit] = entry.values[:, :, :hit]
            past = [
                (seq.keys[i, None, :, :hit], seq.values[i, None, :, :hit]) for i in range(c.num_hidden_layers)
            ]
        seq.length = hit
        seq.cached_tokens = hit if not seq.output_ids else seq.cached_tokens
        seq.routes = [entry.routes[:hit]] if entry is not None and entry.routes is not None and hit else []
        new = torch.tensor([tokens[hit:]], device=self.device)
        with self._routing() as capture:
            logits, kv = self.model(new, past=past)
        if capture is not None:
            seq.routes.append(capture.routes().to(torch.int16))
        self._append_kv(seq, kv, 0)
        self.stats["prompt_tokens"] += len(seq.input_ids) if not seq.output_ids else 0
        self.stats["cached_tokens"] += hit if not seq.output_ids else 0
        self._emit(seq, logits[0, -1].cpu())

    def _decode(self, batch: list[Sequence]) -> None:
        c = self.config
        lengths = [s.length for s in batch]
        longest = max(lengths)
        b = len(batch)
        for s in batch:
            self._reserve(s, longest + 1)
        past = []
        for layer in range(c.num_hidden_layers):
            k = torch.stack([s.keys[layer, :, :longest] for s in batch])  # right-padded
            v = torch.stack([s.values[layer, :, :longest] for s in batch])
            past.append((k, v))
        mask = torch.zeros(b, 1, longest + 1, dtype=torch.bool, device=self.device)
        for i, n in enumerate(lengths):
            mask[i, 0, :n] = True
        mask[:, 0, longest] = True
        last = torch.tensor([[s.tokens[-1]] for s in batch], device=self.device)
        positions = torch.tensor([[n] for n in lengths], device=self.device)
        with self._routing() as capture:
            logits, kv = self.model(last, positions=positions, past=past, mask=mask)
        routes = None if capture is None else capture.routes().to(torch.int16)  # [batch, layers, k]
        self.stats["decode_steps"] += 1
        on_host = logits[:, -1].cpu()  # one device-to-host copy (and sync) a step, not one a sequence
        for i, seq in enumerate(batch):
            if routes is not None:
                seq.routes.append(routes[i : i + 1])
            self._append_kv(seq, kv, i)
            self._emit(seq, on_host[i])

    def _routing(self):  # noqa: ANN202 - a context manager yielding a Capture or None
        """Capture the routed experts of a forward, for a MoE model."""
        return routed(self.model) if self.moe else contextlib.nullcontext()

    @staticmethod
    def _routes(seq: Sequence) -> torch.Tensor | None:
        """Its routes, one piece, [length, layers, k]; None for a dense model."""
        if not seq.routes:
            return None
        if len(seq.routes) > 1:
            seq.routes = [torch.cat(seq.routes)]
        return seq.routes[0]

    def _reserve(self, seq: Sequence, positions: int) -> None:
        """Room for ``positions`` keys/values (doubling), zero beyond what the sequence holds."""
        assert seq.keys is not None and seq.values is not None
        cap = seq.keys.shape[2]
        if positions > cap:
            grow = max(cap, positions - cap)
            seq.keys = torch.cat([seq.keys, torch.zeros_like(seq.keys[:, :, :1]).expand(-1, -1, grow, -1)], 2)
            seq.values = torch.cat(
                [seq.values, torch.zeros_like(seq.values[:, :, :1]).expand(-1, -1, grow, -1)], 2
            )

    def _append_kv(self, seq: Sequence, kv: list[tuple[torch.Tensor, torch.Tensor]], row: int) -> None:
        assert seq.keys is not None and seq.values is not None
        t = kv[0][0].shape[2]
        self._reserve(seq, seq.length + t)
        for layer, (k, v) in enumerate(kv):
            seq.keys[layer, :, seq.length : seq.length + t] = k[row]
            seq.values[layer, :, seq.length : seq.length + t] = v[row]
        seq.length += t

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> None:
        """``logits`` on the host: sampling is seeded on the CPU."""
        token, logprob = sample(logits, seq.params, seq.generator)
        seq.output_ids.append(token)
        seq.logprobs.append(logprob)
        self.stats["generated_tokens"] += 1
        p = seq.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.config.eos_ids))
        if token in stops:
            self._finish(seq, {"type": "stop", "matched": token})
        elif p.stop and (
            hit := next((s for s in p.stop if s in self.tokenizer.decode(seq.output_ids)), None)
        ):
            self._finish(seq, {"type": "stop", "matched": hit})
        elif len(seq.output_ids) >= p.max_new_tokens:
            self._finish(seq, {"type": "length", "length": len(seq.output_ids)})
        elif seq.on_token:
            seq.on_token(seq)

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.on_done(self.response(seq))

    def _release(self, seq: Sequence) -> None:
        """Hand the sequence's keys/values to the prefix cache and drop them from the sequence:
        only keys/values of the weights served now (a sequence that ran across a load holds some
        of an older version, which no later call may reuse)."""
        if seq.keys is not None and seq.length and seq.kv_version == self.weight_version:
            tokens = seq.tokens[: seq.length]
            key = (seq.extra_key, seq.kv_version)
            kv = seq.keys[:, :, : seq.length], seq.values[:, :, : seq.length]
            self.cache.insert(tokens, *kv, key, self._routes(seq))
        seq.keys = seq.values = None
        seq.length = 0

    def response(self, seq: Sequence) -> dict[str, Any]:
        text = self.tokenizer.decode(seq.output_ids)
        reason = seq.finish_reason
        if reason and reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
            text = text[: text.index(reason["matched"])]
        return {
            "text": text,
            "output_ids": list(seq.output_ids),
            "meta_info": {
                "id": seq.rid,
                "prompt_tokens": len(seq.input_ids),
                "completion_tokens": len(seq.output_ids),
                "cached_tokens": seq.cached_tokens,
                "finish_reason": reason,
                "weight_version": self.weight_version,
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(seq.logprobs, seq.output_ids, strict=True)
                ],
                "e2e_latency": time.monotonic() - seq.started,
                **self._routes_info(seq),
            },
        }

    def _routes_info(self, seq: Sequence) -> dict[str, Any]:
        """SGLang's ``routed_experts``: positions ``routes_from`` up to the last forwarded one."""
        routes = self._routes(seq)
        if seq.routes_from is None or routes is None:
            return {}
        data = routes[seq.routes_from :].to(torch.int32).numpy().tobytes()
        return {"routed_experts": base64.b64encode(data).decode()}
