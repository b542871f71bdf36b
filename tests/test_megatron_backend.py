"""The megatron trainer on the CPU (megatron-core over gloo): one micro-step gives the torch
backend's loss and gradients, and one optimizer step the same weights."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import flat_of, gyre
from megatron_worlds import CASES, PARALLEL, model_of
from safetensors import safe_open

from gyre_hpc.builtin_models.resolve import resolve_model
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.models.hf_files import copy_model_files
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.observability.events import read_events
from gyre_hpc.recipe.schema import AgentConfig, CellsConfig, EngineConfig, TrainerConfig
from gyre_hpc.rundir import checkpoint_expert_shards, checkpoint_shards
from gyre_hpc.trainer import checkpoint, weight_shards
from gyre_hpc.trainer.megatron_weights import MegatronLayout, is_expert, slice_shapes
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.sequences import TrainSequence

pytestmark = pytest.mark.megatron

CFG = TrainerConfig(lr=1e-3, grad_clip=0.0)
HERE = Path(__file__).parent


def sequences(vocab: int, n: int = 3, routed: ModelConfig | None = None) -> list[TrainSequence]:
    """``routed``: a routed-expert model's config, whose layers the sequences carry routes for
    (routing replay): k distinct experts a position drawn at random, the first 3 positions none
    (the router's own choice), so a trainer that replays them routes otherwise than it would."""
    rng, draw = np.random.default_rng(0), np.random.default_rng(1)
    out = []
    for i in range(n):
        length = 20 + 7 * i
        mask = (np.arange(length) >= 8).astype(np.float32)
        routes = None
        if routed is not None and routed.num_experts:
            shape = (length, routed.num_hidden_layers, routed.num_experts)
            routes = np.argsort(draw.random(shape), -1)[..., : routed.num_experts_per_tok].astype(np.int16)
            routes[:3] = -1
        out.append(
            TrainSequence(
                f"run{i}",
                rng.integers(0, vocab, length).astype(np.int32),
                mask,
                np.where(mask > 0, -rng.random(length) * 3 - 1, 0).astype(np.float32),
                float(rng.normal()),
                1.0 / 40,
                routes=routes,
            )
        )
    return out


@pytest.mark.parametrize(
    "kind", ["tied (tiny)", "untied, one kv head", "llama", "qwen2", "qwen3_moe", "mixtral"]
)
def test_megatron_micro_step_and_update_match_the_torch_backend(tmp_path: Path, kind: str) -> None:
    """Megatron's step equals transformers' (the torch trainer's) for each dense family's
    converter path: the loss (its log-probs), the gradient, the update (Mistral's tensors and
    attention are Llama's)."""
    from gyre_hpc.trainer import megatron_backend  # needs megatron-core

    model_dir = model_of(kind, tmp_path)
    ours = TorchTrainer(model_dir, CFG, core=True)
    mega = megatron_backend.MegatronTrainer(model_dir, CFG, core=True)
    assert mega.numel == ours.numel
    assert np.array_equal(mega.weights(), ours.weights())  # the same snapshot, converted both ways

    config = ModelConfig.load(model_dir)
    seqs = sequences(config.vocab_size, routed=config)  # a MoE model's: both replay the routes
    a, b = ours.micro_step(seqs), mega.micro_step(seqs)
    assert (a.tokens, a.loss_tokens, a.clipped) == (b.tokens, b.loss_tokens, b.clipped)
    assert b.loss_sum == pytest.approx(a.loss_sum, rel=1e-5)
    g_ours, g_mega = ours.gradient(), mega.hf_gradient()
    assert np.abs(g_mega - g_ours).max() <= 1e-5 * np.abs(g_ours).max()

    ours.apply(3)
    mega.apply(3)
    assert np.abs(mega.weights() - ours.weights()).max() < 1e-5

    mega.load_snapshot(ours.weights().copy(), 7)  # a pulled snapshot lands in Megatron's layout
    assert mega.version == 7 and np.array_equal(mega.weights(), ours.weights())


@pytest.mark.mpi
@pytest.mark.parametrize("case", PARALLEL)
def test_a_data_tensor_or_pipeline_parallel_trainer_matches_one_rank(
    tmp_path: Path,
    case: str,
    megatron_cases,  # noqa: ANN001
) -> None:
    """Each layout of ``megatron_worlds.PARALLEL`` (its cases share a world a size) against one rank."""
    from gyre_hpc.trainer import megatron_backend

    c = CASES[case]
    ranks, tp, pp, ep, count = c.ranks, c.tp, c.pp, c.ep, c.count
    where, model_dir = megatron_cases(case)
    out = where / "parallel.npz"
    got = np.load(out)
    one = megatron_backend.MegatronTrainer(model_dir, CFG, core=True)
    assert np.array_equal(got["before"], one.weights())  # shards and stages gathered back exactly
    config = ModelConfig.load(model_dir)
    stats = one.micro_step(sequences(config.vocab_size, count, routed=config))  # MoE: replayed
    assert float(got["loss"]) == pytest.approx(stats.loss_sum, rel=1e-5) and got["clipped"] == stats.clipped
    g1 = one.hf_gradient().copy()  # apply clears it
    assert np.abs(got["grad"] - g1).max() <= 1e-5 * np.abs(g1).max()
    # The norm: each rank's squares, all-reduced, each replicated tensor counted once.
    assert float(got["norm"]) == pytest.approx(one.apply(3).grad_norm, rel=1e-5)
    # Adam divides each gradient by its own size: one within rounding of its epsilon (1e-8),
    # summed in another order, moves by a share of lr (experts few tokens were routed to)
    moved = np.abs(got["after"] - one.weights())
    assert moved[np.abs(g1) > 1e-6].max(initial=0) < 1e-5 and moved.max() < 0.05 * CFG.lr
    # No rank but the replica's first holds a whole-model buffer (the weights, for engines);
    # each holds its slice, its gradient and Adam's two moments of it, alone: its share of the
    # model, and at most one embedding's shard more (a tied embedding's copy on the last stage,
    # rows padded to a multiple of 128 × tp); its stage's routed experts are whole on every rank.
    config = ModelConfig.load(model_dir)
    layout, flat = MegatronLayout(config, tp, pp, ep), FlatLayout.of(config)
    shapes = {name: shape for name, (_, shape) in flat.slots.items()}
    experts = sum(shape.numel() for name, shape in shapes.items() if ".mlp.experts." in name)
    assert len(got["held"]) == ranks
    for stage, tp_rank, dp_rank, whole_weights, grad, params, moments in got["held"].tolist():
        whole = flat.numel if (stage, tp_rank, dp_rank) == (0, 0, 0) else 0
        cut = slice_shapes(layout, shapes, tp_rank, stage)
        mine = sum(s.numel() for s in cut.values())
        assert (whole_weights, grad, params, moments) == (whole, mine, mine, 2 * mine)
        assert sum(s.numel() for n, s in cut.items() if is_expert(n)) == experts // (pp * ep)
        assert (
            mine
            <= (flat.numel - experts) / (tp * pp)
            + experts / (pp * ep)
            + layout.padded_vocab * config.hidden_size / tp
        )
    # Checkpoint shards: each written by its rank of the first replica, holding its slice alone,
    # read back by the same ranks exactly, and joined into the whole model without a gather.
    shards = where / "shards"
    assert np.array_equal(got["reloaded"], got["after"])
    assert set(checkpoint_shards(shards)) == {(s, t) for s in range(pp) for t in range(tp)}
    # split experts are their expert-parallel rank's shard's alone
    assert set(checkpoint_expert_shards(shards)) == {(s, e) for s in range(pp) for e in range(ep) if ep > 1}
    files = {
        **checkpoint_shards(shards),
        **{(s, -1 - e): f for (s, e), f in checkpoint_expert_shards(shards).items()},
    }
    for (stage, at), f in files.items():
        with safe_open(f, framework="pt") as h:
            held = {name: h.get_slice(name).get_shape() for name in h.keys()}  # noqa: SIM118
        cut = slice_shapes(layout, shapes, max(at, 0), stage)
        assert held == {n: list(s) for n, s in cut.items() if ep == 1 or is_expert(n) == (at < 0)}
    assert sorted(json.loads(str(got["digests"]))) == sorted(
        str(f.relative_to(shards)) for f in files.values()
    )
    copy_model_files(model_dir, shards)
    assert np.array_equal(checkpoint.read_weights(shards), got["after"])
    exported = tmp_path / "hf"
    files = checkpoint.export_hf(shards, exported, bucket_bytes=flat.numel)  # ~4 files of float32
    assert len(files) > 2 and (exported / "model.safetensors.index.json").exists()
    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    state = theirs.state_dict()
    for name, view in flat.views(got["after"]).items():
        assert torch.equal(state[name], view), name
    assert np.array_equal(flat_of(CausalLM.from_pretrained(exported)).numpy(), got["after"])
    # Another layout reshards the weights as it reads them; it would not take this one's optimizer.
    assert weight_shards.other_layout(shards, layout) is None
    said = weight_shards.other_layout(shards, MegatronLayout(config))  # tp = pp = 1
    assert (said is None) == (tp == pp == ep == 1) and (
        said is None or f"written by tp {tp} × pp {pp}" in said
    )
    resharded = megatron_backend.MegatronTrainer(model_dir, CFG, core=True)  # tp = pp = 1
    resharded.load_weights(shards, 9)
    assert resharded.version == 9 and np.array_equal(resharded.weights(), got["after"])


SLICED = [(2, 2, 1, "float32"), (2, 1, 2, "float32"), (2, 1, 1, "float32"), (2, 2, 1, "bfloat16")]
"""(ranks a cell, tp, pp, dtype) of ``test_two_cells_sum_their_gradients…``: one world runs them all."""


@pytest.fixture(scope="module")
def sliced(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, tuple[Path, Path]]:
    """Each case of ``SLICED`` run by ``mpi_programs/sliced_gradients.py``, one after another in one
    world of 1 + 2 cells (a rank's start-up is most of a case's time): case → (its results, its model)."""
    base = tmp_path_factory.mktemp("sliced")
    model_dir = init_tiny(base / "tiny")
    runs = {case: (base / f"{n}" / "sliced.npz", model_dir) for n, case in enumerate(SLICED)}
    todo = []
    for (_, tp, pp, dtype), (out, _) in runs.items():
        out.parent.mkdir()
        todo.append({"model": str(model_dir), "out": str(out), "tp": tp, "pp": pp, "dtype": dtype})
    (base / "cases.json").write_text(json.dumps(todo))
    proc = subprocess.run(
        ["mpirun", "--oversubscribe", "-n", str(1 + 2 * SLICED[0][0]), sys.executable,
         str(HERE / "mpi_programs" / "sliced_gradients.py"), "--cases", str(base / "cases.json")],
        capture_output=True, text=True, timeout=120 + 60 * len(todo),
        # UCX's windows, as between nodes: a Get completes only when its epoch does (shared
        # memory's complete at once, and would hide a read of a header before its flush).
        env={**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
             "OMPI_MCA_osc": "ucx"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return runs


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "tp", "pp", "dtype"), SLICED)
def test_two_cells_sum_their_gradients_and_move_their_weights_slice_by_slice(
    sliced,  # noqa: ANN001
    ranks: int,
    tp: int,
    pp: int,
    dtype: str,
) -> None:
    """A core and a satellite of TP 2, PP 2 (tied embedding: a copy on each end) or DP 2: each
    rank pulls its counterpart's gradient slice, never the whole model; the norm from the
    slices' squares and the step are one rank's that trained every micro-step. Each satellite
    rank then loads its counterpart's weight slice, in the training dtype (bf16: half the bytes
    of fp32; the fp32 masters stay on the core)."""
    from gyre_hpc.trainer import megatron_backend

    out, model_dir = sliced[(ranks, tp, pp, dtype)]
    got, satellite = np.load(out), np.load(out.with_suffix(".satellite.npz"))
    # What each rank registered with the transport: its slice (weights on the core's ranks,
    # gradient on the satellite's), and no whole snapshot: a cell whose leader alone hosts its
    # engine streams it from the slices (the snapshot's 8-byte header is all the core exposes).
    config = ModelConfig.load(model_dir)
    layout, flat = MegatronLayout(config, tp, pp), FlatLayout.of(config)
    shapes = {name: shape for name, (_, shape) in flat.slots.items()}
    registered = np.load(out.with_suffix(".registered.npy")).tolist()
    for rank, (snapshot, weights, gradient) in enumerate(registered):
        unit, i = (None, 0) if rank == 0 else divmod(rank - 1, ranks)
        stage, tp_rank, _ = layout.place(i, ranks)
        mine = 4 * sum(s.numel() for s in slice_shapes(layout, shapes, tp_rank, stage).values())
        assert snapshot == (8 if rank == 1 else 0), rank
        assert weights == (16 + mine if unit == 0 else 0) and gradient == (mine if unit == 1 else 0), rank
    if dtype == "bfloat16":  # the satellite holds the core's bf16 weights: the masters rounded
        assert np.abs(satellite["weights"] - got["after"]).max() <= 2**-8 * np.abs(got["after"]).max()
        for held, capacity in satellite["sizes"]:  # bf16 values, fp32 norms: about half of fp32
            assert held < 0.55 * capacity
        return
    assert np.array_equal(satellite["weights"], got["after"])
    assert all(held == capacity for held, capacity in satellite["sizes"])
    one = megatron_backend.MegatronTrainer(model_dir, replace(CFG, grad_clip=1e-3), core=True)
    seqs = sequences(ModelConfig.load(model_dir).vocab_size, 4)
    one.micro_step(seqs[:2])
    one.micro_step(seqs[2:])
    stats = one.apply(3)
    assert float(got["norm"]) == pytest.approx(stats.grad_norm, rel=1e-5) and stats.grad_norm / 3 > 1e-3
    assert np.abs(got["after"] - one.weights()).max() < 1e-5


def test_checkpoints_are_hugging_face_directories_whatever_the_backend(tmp_path: Path) -> None:
    from gyre_hpc.trainer import checkpoint, megatron_backend

    model_dir = init_tiny(tmp_path / "tiny")
    mega = megatron_backend.MegatronTrainer(model_dir, CFG, core=True)
    mega.micro_step(sequences(ModelConfig.load(model_dir).vocab_size))
    mega.apply(3)
    saved = checkpoint.save(tmp_path / "ckpt", 1, mega, model_dir)
    # The engines' own loader reads it, and a torch trainer resumes from it, exactly.
    assert np.array_equal(flat_of(CausalLM.from_pretrained(saved)).numpy(), mega.weights())
    ours = TorchTrainer(model_dir, CFG, core=True)
    checkpoint.restore(saved, ours)
    assert ours.version == 1 and np.array_equal(ours.weights(), mega.weights())
    again = megatron_backend.MegatronTrainer(model_dir, CFG, core=True)
    checkpoint.restore(saved, again)
    assert again.version == 1 and np.array_equal(again.weights(), mega.weights())


def smoke_run(runs_dir: Path, *sets: str, resume: Path | None = None) -> Path:
    """Two short steps of the smoke recipe with megatron cells; the run directory."""
    where = (
        ["--resume", str(resume)] if resume else ["recipes/smoke.toml", "--set", f"run.runs_dir={runs_dir}"]
    )
    proc = gyre(
        "run", *where,
        "--set", f"run.model={resolve_model('tiny-warm')}",
        "--set", "trainer.backend=megatron",
        "--set", "run.steps=2",
        "--set", "tasks.prompts_per_step=2",
        "--set", "tasks.eval_every=0",
        "--set", "agent.max_calls=2",
        "--set", "run.seed=1",  # seed 0's first two prompts all fail: a step without signal
        *sets,
        timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return resume or next(runs_dir.iterdir())


def step_events(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir / "events.jsonl") if e.kind == "step"]


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_the_runtime_trains_with_megatron_cells_of_one_rank_or_of_several(tmp_path: Path) -> None:
    """One rank per cell against two pipeline stages per cell (tests/test_slurm_job.py runs
    tensor-parallel cells end to end; by hand, TP 2 updates differ from one rank's by 1.4e-4)."""
    from safetensors.numpy import load_file

    one_cell = ("--set", "cells.count=1")  # the comparison needs no more
    # The transport's reads of snapshots and gradients go in 1 MiB parts (the tiny model is 3.4
    # MiB): the path an 8.19e9-element buffer takes past MPI's 32-bit counts.
    pp = ("--set", "trainer.pp_size=2", "--set", "cells.ranks_per_cell=2")
    pp += ("--set", "transport.mpi_chunk_mb=1", "--set", "trainer.export_every=2")
    pp += (
        "--set",
        "engine.tp_size=2",
    )  # one replica a cell, at the leader: it streams from the slices
    # Side by side: each waits on its engines and ranks part of the time.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = (
            pool.submit(smoke_run, tmp_path / "tp1", *one_cell),
            pool.submit(smoke_run, tmp_path / "pp2", *one_cell, *pp),
        )
        one, pp2 = (r.result() for r in runs)
    assert [s.version for s in step_events(pp2)] == [1, 2]
    assert all(s.micro_steps > 0 for s in step_events(pp2))
    # Each cell's replica spans both of its ranks (its leader alone cannot compute a step), and
    # both shapes train the same: same samples, same gradients, same update.
    for a, b in zip(step_events(one), step_events(pp2), strict=True):
        assert a.groups == b.groups
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
    start = load_file(str(resolve_model("tiny-warm") / "model.safetensors"))
    ckpt = "checkpoints/step-000002/model.safetensors"
    w1, w2 = load_file(str(one / ckpt)), load_file(str(pp2 / ckpt))
    d1 = np.concatenate([(w1[k] - start[k]).ravel() for k in start])
    d2 = np.concatenate([(w2[k] - start[k]).ravel() for k in start])
    assert np.linalg.norm(d2 - d1) <= 1e-3 * np.linalg.norm(d1)  # measured: 1.4e-4
    # Each rank of the replica wrote its own weights and optimizer state, digested; step 2's
    # checkpoint (trainer.export_every = 2) is also a Hugging Face model, step 1's is not.
    state = json.loads((pp2 / "checkpoints/step-000002/state.json").read_text())
    assert sorted(state["sha256"]) == [
        "megatron/stage-0-tp-0.safetensors", "megatron/stage-1-tp-0.safetensors", "model.safetensors",
        "optimizer-rank-0.pt", "optimizer-rank-1.pt"]  # fmt: skip
    assert not (pp2 / "checkpoints/step-000002/optimizer.pt").exists()
    assert not (pp2 / "checkpoints/step-000001/model.safetensors").exists()
    # Any checkpoint exports, a bucket at a time: the files transformers reads hold its weights.
    out = tmp_path / "exported"
    said = gyre("model", "export", str(pp2 / "checkpoints/step-000001"), str(out), "--bucket-gib", "0.001")
    assert said.returncode == 0 and "wrote" in said.stdout, said.stderr
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    layout = FlatLayout.of(ModelConfig.load(out))
    for name, view in layout.views(checkpoint.read_weights(pp2 / "checkpoints/step-000001")).items():
        assert torch.equal(theirs[name], view), name
    again = gyre("model", "export", str(pp2), str(out))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "not empty" in again.stderr
    smoke_run(tmp_path, "--set", "run.steps=3", resume=pp2)
    assert [s.version for s in step_events(pp2)][-1] == 3
    logs = "".join(p.read_text() for p in (pp2 / "logs").glob("rank-*.log"))
    assert "core: resumed from" in logs and "AdamW starts afresh" not in logs
    # No whole snapshot: each version went into the engine as tensors gathered from the slices.
    assert "version 3 streamed from the cell's slices into its engine" in logs


def test_bfloat16_computes_in_bf16_and_steps_fp32_master_weights(tmp_path: Path) -> None:
    from gyre_hpc.trainer import megatron_backend

    model_dir = init_tiny(tmp_path / "tiny")
    fp32 = megatron_backend.MegatronTrainer(model_dir, CFG, core=True)
    bf16 = megatron_backend.MegatronTrainer(model_dir, replace(CFG, dtype="bfloat16"), core=True)
    assert all(p.dtype == torch.bfloat16 for n, p in bf16.params.items() if "norm" not in n)  # norms: fp32
    assert bf16.master is not None and all(m.dtype == torch.float32 for m in bf16.master.values())
    assert np.array_equal(bf16.weights(), fp32.weights())  # snapshots come from the fp32 masters
    seqs = sequences(ModelConfig.load(model_dir).vocab_size)
    a, b = fp32.micro_step(seqs), bf16.micro_step(seqs)
    assert b.loss_sum == pytest.approx(a.loss_sum, rel=0.05) and b.loss_sum != a.loss_sum
    ga, gb = fp32.gradient(), bf16.gradient()
    assert float(ga @ gb / (np.linalg.norm(ga) * np.linalg.norm(gb))) > 0.99
    before = fp32.weights().copy()
    fp32.apply(3)
    bf16.apply(3)
    da, db = fp32.weights() - before, bf16.weights() - before
    assert float(da @ db / (np.linalg.norm(da) * np.linalg.norm(db))) > 0.9  # the same step, in fp32
    assert all(torch.equal(p, bf16.master[n].to(p.dtype)) for n, p in bf16.params.items())
    # The step's gradients are dropped with it: the GPU would keep a model of fp32 while it samples.
    for trainer in (fp32, bf16):
        held = [*trainer.params.values(), *(trainer.master or {}).values()]
        assert all(t.grad is None for t in held)


def saved_for_backward(trainer, seqs: list[TrainSequence]) -> int:  # noqa: ANN001
    """Bytes one forward (grad on, no backward) leaves saved for backward."""
    total = 0

    def keep(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    unit = trainer._path_unit(seqs[0])
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        trainer._forward(unit)
    return total


def test_full_recomputation_keeps_a_fraction_of_the_activations_for_the_same_gradient(tmp_path: Path) -> None:
    """``trainer.recompute`` reaches megatron's TransformerConfig: what a forward keeps for
    backward shrinks, the step does not change."""
    from gyre_hpc.trainer import megatron_backend

    model_dir = init_tiny(tmp_path / "tiny")
    seqs = sequences(ModelConfig.load(model_dir).vocab_size)
    kept, grads = {}, {}
    for mode in ("none", "full"):
        t = megatron_backend.MegatronTrainer(model_dir, replace(CFG, recompute=mode), core=True)
        assert t.model.config.recompute_granularity == (None if mode == "none" else "full")
        kept[mode] = saved_for_backward(t, seqs)
        t.micro_step(seqs)
        grads[mode] = t.gradient().copy()
    assert kept["full"] < kept["none"] / 3, kept
    assert np.abs(grads["full"] - grads["none"]).max() <= 1e-6 * np.abs(grads["none"]).max()


def test_gradients_accumulate_in_fp32_and_reach_the_host_buffer_once_asked(tmp_path: Path) -> None:
    """bf16 parameters: each micro-step's gradient is added to an fp32 sum on the trainer's
    device; the flat buffer the transport reads is written when ``gradient()`` is asked."""
    from gyre_hpc.trainer import megatron_backend

    model_dir = init_tiny(tmp_path / "tiny")
    t = megatron_backend.MegatronTrainer(model_dir, replace(CFG, dtype="bfloat16"), core=True)
    assert t.model.config.bf16  # the attention softmax is upcast
    seqs = sequences(ModelConfig.load(model_dir).vocab_size)
    t.micro_step(seqs[:1])
    t.micro_step(seqs[1:])
    assert not t.grad.any()  # nothing copied to the host per micro-step
    assert all(g.dtype == torch.float32 for g in t.main_grad.values())
    assert all(p.grad is None for p in t.params.values())  # the bf16 copies live one backward
    both = t.gradient().copy()
    assert both.any() and not t.main_grad
    assert np.array_equal(t.gradient(), both)  # asked again: nothing added twice
    t.zero_grad()
    t.micro_step(seqs)
    once = t.gradient()
    assert float(once @ both / (np.linalg.norm(once) * np.linalg.norm(both))) > 0.999


def test_a_released_trainer_hands_back_what_the_memory_plan_counts_and_trains_on_as_before(
    tmp_path: Path,
) -> None:
    """What ``release_memory`` moves to the host on a GPU (here moved by hand: on the CPU there is
    nothing to hand back): every resident tensor, the bytes the plan counts for weights, fp32
    masters and Adam, and the step after it is the step of a trainer that never let go. Its
    weights are gathered from the released slices too (a restored core's, which nothing
    gathered before it let go)."""
    from gyre_hpc.plan.memory import plan
    from gyre_hpc.trainer import megatron_backend

    model_dir = init_tiny(tmp_path / "tiny")
    cfg = replace(CFG, dtype="bfloat16", backend="megatron")
    kept, moved = (megatron_backend.MegatronTrainer(model_dir, cfg, core=True) for _ in range(2))
    seqs = sequences(ModelConfig.load(model_dir).vocab_size)
    for t in (kept, moved):
        t.micro_step(seqs)
        t.gradient()
        t.apply(3)  # Adam's moments exist from here
    moved.weights()  # taken while resident, as the cell does
    released = moved.offload.release(moved._resident())
    p = plan(ModelConfig.load(model_dir), CellsConfig(gpu_memory_gib=80), EngineConfig(), cfg, AgentConfig())
    counted = {part.what: part.bytes for part in p.training.parts}
    planned = counted["weights"] + counted["fp32 master + Adam"]
    assert released == pytest.approx(planned, rel=0.002)  # the norms' weights are fp32, not bf16
    assert np.array_equal(moved.weights(), kept.weights())  # answered from the snapshot
    moved.offload.resume(moved._resident(), moved.device)
    for t in (kept, moved):
        t.zero_grad()
        t.micro_step(seqs)
        t.gradient()
        t.apply(3)
    assert np.array_equal(moved.weights(), kept.weights())
    moved.offload.release(moved._resident())
    moved.fresh, moved.flat = False, np.empty(0, np.float32)
    assert np.array_equal(moved.weights(), kept.weights())
    assert moved.offload.released


def test_the_megatron_benchmark_runs_at_tiny_size(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "tools/bench_megatron.py", "--size", "tiny", "--seq", "64", "--steps", "1",
         "--dir", str(tmp_path), "--tree", "256", "--leaves", "4"],
        capture_output=True, text=True, timeout=300, cwd=HERE.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads((tmp_path / "bench_megatron.json").read_text())
    assert figures["train_tokens_per_s"] > 0 and figures["snapshot_export_gb_per_s"] > 0
    # Each export gathers anew, converting as megatron_to_hf does (a cached snapshot took ~1 µs).
    assert figures["snapshot_export_s"] >= 0.5 * figures["megatron_to_hf_s"] > 0
    assert figures["tree_unique_tokens"] == 256 and figures["tree_path_tokens"] == 4 * (192 + 16)


LATE_LEADER = Path(__file__).parent / "mpi_programs" / "late_leader.py"


def rendezvous(port: int, delay_s: float, start_timeout_s: float) -> list[subprocess.Popen[str]]:
    """Rank 1 joins at once, rank 0 after ``delay_s`` (its engine starting); heartbeat timeout 1 s."""
    return [
        subprocess.Popen(
            [sys.executable, str(LATE_LEADER), str(rank), str(port), str(delay_s), str(start_timeout_s), "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 0)
    ]


def test_a_member_waits_at_the_rendezvous_as_long_as_its_leader_s_engine_may_take_to_start() -> None:
    """torch's own store timeout (300 s) is shorter than an 8B server's start; the members'
    wait is the engine's start timeout instead: past it, one line, not a hang."""
    from gyre_hpc.launch.ports import free_port

    ports = [free_port("127.0.0.1")]
    while (port := free_port("127.0.0.1")) == ports[0]:
        pass
    # Both cases side by side (their time is mostly waiting): a late leader, and one too late.
    member, leader = rendezvous(ports[0], delay_s=4, start_timeout_s=20)
    late_member, late_leader = rendezvous(port, delay_s=600, start_timeout_s=2)
    said = {}
    for proc, rank in ((member, 1), (leader, 0)):
        said[rank], err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and f"rank {rank} up" in said[rank], err[-2000:]
    assert float(said[1].split()[-2]) >= 3  # it waited for the late leader

    try:
        out, err = late_member.communicate(timeout=60)  # 3 s allowed: far below torch's 300
    finally:
        late_leader.kill()
    assert late_member.returncode == 3, err[-2000:]
    assert "rank 1 of 2: the replica's rendezvous at 127.0.0.1:" in err and "within 3 s" in err, err[-2000:]


def test_the_router_s_auxiliary_losses_are_recipe_keys_that_reach_its_gradient(tmp_path: Path) -> None:
    """Off by default (the router learns from the policy loss alone, as the torch trainer's does);
    each coefficient adds its term's gradient to the router's, and nothing to the reported loss."""
    from gyre_hpc.trainer import megatron_backend

    model_dir = model_of("qwen3_moe", tmp_path)
    config = ModelConfig.load(model_dir)
    seqs, layout = sequences(config.vocab_size), FlatLayout.of(config)
    routers = [n for n in layout.slots if n.endswith("mlp.gate.weight")]
    got = {}
    for aux, z in [(0.0, 0.0), (0.01, 0.0), (0.0, 0.001)]:
        trainer = megatron_backend.MegatronTrainer(
            model_dir, dataclasses.replace(CFG, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z), core=True
        )
        loss = trainer.micro_step(seqs).loss_sum
        views = layout.views(trainer.hf_gradient())
        got[aux, z] = loss, np.concatenate([views[n].numpy().ravel() for n in routers])
    (loss, plain), *others = got.values()
    for other_loss, router in others:
        assert other_loss == pytest.approx(loss, rel=1e-6)
        assert np.abs(router - plain).max() > 1e-3 * np.abs(plain).max()
