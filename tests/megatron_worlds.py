"""Megatron trainers over several ranks, shared by the tests that check them: each case of
``mpi_programs/megatron_parallel.py`` (a layout, a model, paths or a packed tree) runs once, and
the cases of one world size run one after another in one world, since a rank's start-up (torch,
megatron-core, transformers) costs more than a case. Tests then read a case's results from its
directory: the model it trained, ``parallel.npz`` and the ``shards/`` its ranks wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.causal_lm import CausalLM, save_weights
from gyre_hpc.models.tiny import init_tiny

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Case:
    ranks: int
    tp: int
    pp: int
    ep: int
    kind: str
    """The model: ``model_of``'s kinds."""
    count: int = 3
    """Sequences of ``test_megatron_backend.sequences`` (paths)."""
    packing: str = "paths"


CASES: dict[str, Case] = {}


def case_id(c: Case) -> str:
    return f"{c.packing}-{c.ranks}-{c.tp}-{c.pp}-{c.ep}-{c.kind}-{c.count}"


def _register(*cases: Case) -> list[str]:
    ids = [case_id(c) for c in cases]
    CASES.update(zip(ids, cases, strict=True))
    return ids


PARALLEL = _register(
    Case(2, 2, 1, 1, "tied (tiny)"), Case(2, 1, 2, 1, "tied (tiny)"), Case(2, 1, 2, 1, "untied"),
    Case(4, 2, 2, 1, "tied (tiny)"), Case(2, 1, 1, 1, "tied (tiny)"),
    Case(2, 1, 1, 1, "tied (tiny)", count=1),  # one replica's share empty: zero gradients, summed alike
    Case(2, 2, 1, 1, "llama"), Case(2, 1, 2, 1, "qwen2"),  # the other dense families' paths: TP, PP
    # routed experts: split over the replicas' ranks (one replica's share empty: it forwards idle
    # units while the other exchanges tokens), over TP ranks (sequence parallel), and PP
    Case(2, 1, 1, 2, "mixtral", count=1), Case(2, 2, 1, 2, "qwen3_moe"), Case(2, 1, 2, 1, "mixtral"),
)  # fmt: skip
"""``test_megatron_backend``'s layouts."""

TREES = _register(*(Case(2, tp, pp, 1, "tied (tiny)", packing="tree") for tp, pp in [(2, 1), (1, 2), (1, 1)]))
"""``test_tree_packing``'s: a packed tree over TP, PP or data-parallel ranks."""


def untied(tmp_path: Path) -> Path:
    """A small untied model (the tiny one ties its embeddings): lm_head goes to output_layer."""
    tiny = ModelConfig.load(init_tiny(tmp_path / "tiny"))
    c = replace(tiny, tie_word_embeddings=False, num_key_value_heads=1)
    model_dir = tmp_path / "untied"
    model_dir.mkdir(exist_ok=True)
    torch.manual_seed(1)
    model = CausalLM(c)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    save_weights(model, model_dir / "model.safetensors")
    (model_dir / "config.json").write_text(json.dumps(c.to_hf()))
    return model_dir


def model_of(kind: str, tmp_path: Path) -> Path:
    """The tiny model ("tied (tiny)"), the untied one, or another family's tiny model (its name:
    Llama 3 untied with scaled rotary frequencies, Qwen2 with q/k/v biases, the two MoE families)."""
    if kind.startswith("tied"):
        return init_tiny(tmp_path / "tiny")
    if kind.startswith("untied"):
        return untied(tmp_path)
    return init_tiny(tmp_path / kind, seed=2, family=kind)


def run_cases(ids: list[str], base: Path) -> dict[str, tuple[Path, Path]]:
    """Each case in ``base``/<n>, the cases of a world size in one world; case id → (its
    directory, its model)."""
    dirs = {i: base / str(n) for n, i in enumerate(ids)}
    models = {}
    for ranks in sorted({CASES[i].ranks for i in ids}):
        todo = []
        for i in ids:
            c = CASES[i]
            if c.ranks != ranks:
                continue
            dirs[i].mkdir(parents=True, exist_ok=True)
            model = models[i] = model_of(c.kind, dirs[i])
            todo.append({"model": str(model), "out": str(dirs[i] / "parallel.npz"), "tp": c.tp, "pp": c.pp,
                         "packing": c.packing, "count": c.count, "ep": c.ep})  # fmt: skip
        cases = base / f"cases-{ranks}.json"
        cases.write_text(json.dumps(todo))
        proc = subprocess.run(
            ["mpirun", "--oversubscribe", "-n", str(ranks), sys.executable,
             str(HERE / "mpi_programs" / "megatron_parallel.py"), "--cases", str(cases)],
            capture_output=True, text=True, timeout=180 + 60 * len(todo),
            env={**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(
                f"{ranks}-rank world of {len(todo)} cases: " + proc.stdout[-2000:] + proc.stderr[-3000:]
            )
    return {i: (dirs[i], models[i]) for i in ids}
