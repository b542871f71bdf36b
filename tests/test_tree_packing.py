"""Tree packing: the packed micro-step forwards each shared prefix once and gives the paths' loss
and gradient, on the torch backend (chain by chain over cached keys and values) and on megatron
(a tree mask; one rank, tensor-, pipeline- and data-parallel)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron_worlds import TREES

from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trainer.tree_attention import block_mask, dense_mask, padded_length
from gyre_hpc.trajectory.packing import (
    PrefixTrie,
    forwarded_tokens,
    pack_tree,
    pack_tree_micro_steps,
    unique_tokens,
)
from gyre_hpc.trajectory.sequences import TrainSequence

CFG = TrainerConfig(lr=1e-3, grad_clip=0.0)


def forest(
    rng: np.random.Generator,
    *,
    runs: int,
    branching: int,
    depth: int,
    prefix: int,
    segment: int,
    p_train: float,
    vocab: int,
) -> list[TrainSequence]:
    """Each run: a shared prompt of ``prefix`` tokens, then a tree ``depth`` levels deep that
    forks ``branching`` ways at every level into segments of 1…``segment`` tokens; every leaf
    is a path, and some paths stop early (a path that is a prefix of another). Runs share the
    prompt, and the last run repeats the first one's first path (the same tokens sampled twice)."""
    prompt = rng.integers(0, vocab, prefix)
    out: list[TrainSequence] = []
    first_path = None
    for r in range(runs):
        leaves = [prompt]
        for _ in range(depth):
            leaves = [
                np.concatenate([p, rng.integers(0, vocab, rng.integers(1, segment + 1))])
                for p in leaves
                for _ in range(branching)
            ]
        leaves = [p[: rng.integers(prefix, len(p) + 1)] if rng.random() < 0.2 else p for p in leaves]
        if r == runs - 1 and r > 0 and first_path is not None:
            leaves.append(first_path)
        first_path = first_path if first_path is not None else leaves[0]
        masks = [(rng.random(len(p)) < p_train) & (np.arange(len(p)) > 0) for p in leaves]
        total = max(int(sum(m.sum() for m in masks)), 1)
        advantage = float(rng.normal())
        for p, m in zip(leaves, masks, strict=True):
            behaviour = np.where(m, -rng.random(len(p)) * 3 - 0.1, 0).astype(np.float32)
            mask = m.astype(np.float32)
            out.append(TrainSequence(f"run{r}", p.astype(np.int32), mask, behaviour, advantage, 1 / total))
    return out


def forked_sequences(vocab: int) -> list[TrainSequence]:
    """A fixed forest (three runs, shared prompt, two-way forks three deep) for the MPI program."""
    rng = np.random.default_rng(7)
    return forest(rng, runs=3, branching=2, depth=3, prefix=24, segment=9, p_train=0.6, vocab=vocab)


forests = st.fixed_dictionaries(
    {
        "runs": st.integers(1, 3),
        "branching": st.integers(1, 3),
        "depth": st.integers(1, 3),
        "prefix": st.integers(1, 40),
        "segment": st.integers(1, 12),
        "p_train": st.sampled_from([0.0, 0.3, 1.0]),
        "seed": st.integers(0, 2**16),
    }
)


def draw(spec: dict, vocab: int) -> list[TrainSequence]:
    rng = np.random.default_rng(spec["seed"])
    return forest(rng, vocab=vocab, **{k: v for k, v in spec.items() if k != "seed"})


# ---- the packing itself -------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(forests, st.sampled_from([4, 50]))
def test_every_path_is_found_in_the_packed_tree_seeing_exactly_its_prefix(spec: dict, vocab: int) -> None:
    seqs = draw(spec, vocab)
    tree = pack_tree(seqs)
    prefixes = {tuple(s.tokens[: i + 1].tolist()) for s in seqs for i in range(len(s))}
    assert len(tree) == len(prefixes) == unique_tokens(seqs)  # each unique (prefix, token) once
    visible = dense_mask(tree.ends).numpy()  # the rule as the megatron trainer applies it
    assert np.array_equal(pack_tree(seqs).tokens, tree.tokens)  # deterministic
    entries = 0
    for s in seqs:
        at = np.concatenate([seg.start + np.arange(len(seg.tokens)) for seg in pack_tree_chain(seqs, s)])
        assert np.array_equal(tree.tokens[at], s.tokens)
        assert np.array_equal(tree.positions[at], np.arange(len(s)))
        assert tree.parents[at[0]] == -1 and np.array_equal(tree.parents[at[1:]], at[:-1])
        for t in range(len(s)):
            assert set(np.flatnonzero(visible[at[t]]).tolist()) == set(at[: t + 1].tolist())
        entries += int(s.loss_mask.sum())
    assert len(tree.targets) == entries
    assert tree.path_tokens == sum(len(s) for s in seqs)
    chains = tree.chains()  # what the torch backend forwards one after another
    assert [a for a, _ in chains[1:]] == [b for _, b in chains[:-1]] and chains[-1][1] == len(tree)
    for a, b in chains:
        assert np.array_equal(tree.parents[a + 1 : b], np.arange(a, b - 1))
        assert np.array_equal(tree.ancestors(a), np.flatnonzero(visible[a, :a]))
    assert len(chains) == len({tuple(s.tokens.tolist()) for s in seqs} - {p[:-1] for p in prefixes})


def pack_tree_chain(seqs: list[TrainSequence], s: TrainSequence) -> list:
    """The segments ``s`` runs through once all of ``seqs`` are in (starts laid out)."""
    trie = PrefixTrie()
    for x in seqs:
        trie.add(np.asarray(x.tokens, dtype=np.int64))
    trie.layout()
    return trie.chain(np.asarray(s.tokens, dtype=np.int64))


@settings(max_examples=100, deadline=None)
@given(forests, st.integers(8, 200))
def test_tree_micro_steps_hold_every_sequence_once_within_the_unique_token_budget(
    spec: dict, budget: int
) -> None:
    seqs = draw(spec, 50)
    bins = pack_tree_micro_steps(seqs, budget)
    assert sorted(id(s) for b in bins for s in b) == sorted(id(s) for s in seqs)
    for b in bins:
        assert unique_tokens(b) <= budget or len(b) == 1


def test_a_deep_shared_prefix_is_forwarded_once() -> None:
    rng = np.random.default_rng(0)
    seqs = forest(rng, runs=1, branching=5, depth=1, prefix=3000, segment=100, p_train=1.0, vocab=1000)
    tree = pack_tree(seqs)
    assert tree.path_tokens >= 5 * 3000 and len(tree) <= 3000 + 5 * 100
    assert len(pack_tree_micro_steps(seqs, 4000)) == 1  # the unique tokens fit one micro-step


# ---- gradients: torch backend -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("tree") / "tiny")


@pytest.fixture(scope="module")
def torch_pair(tiny: Path) -> tuple[TorchTrainer, TorchTrainer]:
    return TorchTrainer(tiny, CFG, core=True), TorchTrainer(tiny, CFG, core=True, packing="tree")


def assert_same_step(paths, tree, seqs: list[TrainSequence], forwarded: int) -> None:  # noqa: ANN001
    paths.zero_grad()
    tree.zero_grad()
    a, b = paths.micro_step(seqs), tree.micro_step(seqs)
    assert b.loss_sum == pytest.approx(a.loss_sum, rel=1e-5, abs=1e-7)
    assert (b.loss_tokens, b.clipped, b.sequences) == (a.loss_tokens, a.clipped, a.sequences)
    assert b.tokens == forwarded <= a.tokens
    ga, gb = paths.hf_gradient(), tree.hf_gradient()
    assert np.abs(gb - ga).max() <= 1e-5 * max(np.abs(ga).max(), 1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(forests)
def test_the_torch_tree_micro_step_gives_the_paths_loss_and_gradient(
    torch_pair: tuple[TorchTrainer, TorchTrainer], tiny: Path, spec: dict
) -> None:
    seqs = draw(spec, ModelConfig.load(tiny).vocab_size)
    assert_same_step(*torch_pair, seqs, unique_tokens(seqs))  # one forest, chain by chain


RULES = {
    "gspo, geometric mask": dict(policy_loss="gspo", mismatch_correction="geometric-mask", mismatch_low=0.9,
                                 mismatch_cap=1.1),
    "cispo, mis": dict(policy_loss="cispo", mismatch_correction="mis", mismatch_low=0.2, mismatch_cap=5.0),
    "ppo, sequence tis": dict(mismatch_correction="sequence-tis"),
}  # fmt: skip


@pytest.mark.parametrize("rule", RULES)
def test_path_level_rules_give_the_same_step_on_a_tree(tiny: Path, rule: str) -> None:
    """Sequence ratios, sequence weights and rejections read each entry's own path in a tree:
    the packed step equals the paths' (the forest's paths are all sampled at the version trained,
    their behaviour log-probs near the model's so that some tokens are kept and some rejected)."""
    cfg = dataclasses.replace(CFG, **RULES[rule])
    paths, tree = TorchTrainer(tiny, cfg, core=True), TorchTrainer(tiny, cfg, core=True, packing="tree")
    rng = np.random.default_rng(5)
    seqs = []
    for s in forked_sequences(ModelConfig.load(tiny).vocab_size):
        near = np.where(
            s.loss_mask > 0, -np.log(ModelConfig.load(tiny).vocab_size) + rng.normal(0, 1, len(s)), 0
        )
        seqs.append(
            dataclasses.replace(s, behaviour_logprobs=near.astype(np.float32), versions=np.zeros(len(s), int))
        )
    assert_same_step(paths, tree, seqs, unique_tokens(seqs))
    stats = paths.micro_step(seqs).token_stats
    if RULES[rule]["mismatch_correction"] != "sequence-tis":
        assert 0 < stats.masked < stats.tokens


# ---- gradients: megatron ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_tree(tiny: Path):  # noqa: ANN201 - a MegatronTrainer (megatron-core is optional)
    from gyre_hpc.trainer.megatron_backend import MegatronTrainer

    return MegatronTrainer(tiny, CFG, core=True, packing="tree")


@pytest.mark.megatron
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(forests)
def test_the_megatron_tree_micro_step_gives_the_paths_loss_and_gradient(
    torch_pair: tuple[TorchTrainer, TorchTrainer],
    megatron_tree,
    tiny: Path,
    spec: dict,  # noqa: ANN001
) -> None:
    seqs = draw(spec, ModelConfig.load(tiny).vocab_size)
    assert_same_step(torch_pair[0], megatron_tree, seqs, forwarded_tokens(seqs))  # a dense tree per run


@pytest.mark.megatron
def test_padding_is_forwarded_but_not_counted_and_an_empty_share_forwards_nothing(
    torch_pair: tuple[TorchTrainer, TorchTrainer],
    megatron_tree,  # noqa: ANN001
    tiny: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA each tree is padded to its bucket's length (``tree_attention.padded_length``):
    with that padding here, the step is the paths' and its tokens are the trees' own; and a
    data-parallel replica whose share of a micro-step is empty forwards no tree of padding."""
    from gyre_hpc.trainer import megatron_backend

    t = megatron_tree
    monkeypatch.setattr(t, "pad_trees", True)
    # One forest a micro-step, as under block masks on CUDA (here the dense mask of the same tree).
    monkeypatch.setattr(megatron_backend, "forward_trees", lambda seqs, block_sparse: [pack_tree(seqs)])
    seqs = forked_sequences(ModelConfig.load(tiny).vocab_size)
    assert padded_length(unique_tokens(seqs), t.config.micro_step_tokens) > unique_tokens(seqs)
    assert_same_step(torch_pair[0], t, seqs, unique_tokens(seqs))
    empty = t._tree_unit(pack_tree([]))
    assert empty.length > 0 and empty.tokens == 0
    forwards: list[int] = []
    hook = t.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        t.zero_grad()
        assert t.micro_step([]).tokens == 0 and forwards == []
    finally:
        hook.remove()


@pytest.mark.megatron
def test_the_megatron_model_is_built_whole_on_the_trainer_s_device(
    megatron_tree,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU megatron allocates its layers on ``torch.cuda.current_device()`` while its local
    spec's norms are plain torch modules: built as megatron builds for a GPU, with the device
    pointed at ``meta`` here, no tensor of the model may be left elsewhere (they were on the host)."""
    from gyre_hpc.trainer.megatron_backend import build_model

    t = megatron_tree
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    meta = torch.device("meta")
    for recompute in ("none", "full"):
        model = build_model(t.model_config, t.layout, torch.bfloat16, recompute=recompute, device=meta)
        tensors = [*model.parameters(), *model.buffers()]
        assert tensors and {x.device for x in tensors} == {meta}
        norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
        assert len(norms) == 4 * t.model_config.num_hidden_layers + 1  # input, q, k, pre-MLP; final


@pytest.mark.megatron
def test_megatron_attention_takes_the_block_mask_as_the_dense_mask(megatron_tree, tiny: Path) -> None:  # noqa: ANN001
    """What a megatron cell on CUDA computes with (forward only, as FlexAttention on the CPU)."""
    from gyre_hpc.trainer.base import tree_inputs
    from gyre_hpc.trainer.megatron_backend import PositionedRotary, build_model

    tree = pack_tree(forked_sequences(ModelConfig.load(tiny).vocab_size))
    t = megatron_tree
    blocky = build_model(t.model_config, t.layout, t.dtype, block_masks=True)
    blocky.rotary_pos_emb = PositionedRotary(blocky.rotary_pos_emb)
    blocky.load_state_dict(t.model.state_dict())
    t._emit_hidden(blocky.output_layer)  # the trainer's forward ends at the last hidden states
    ids, positions = tree_inputs(tree)
    blocky.rotary_pos_emb.positions = positions[0]
    with torch.no_grad():
        dense = t._forward(t._tree_unit(tree))
        blocks = blocky(ids, positions, attention_mask=block_mask(tree.ends, torch.device("cpu")))
    assert torch.allclose(blocks, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.megatron
def test_with_recomputation_the_block_mask_reaches_every_layer_beside_megatron_s_arguments(
    megatron_tree,  # noqa: ANN001
    tiny: Path,
) -> None:
    """Recomputation saves the block's arguments for backward, and saves only tensors: a block
    mask handed as ``attention_mask`` fails there (forward with grad on: the checkpointed layers
    run without grad, so FlexAttention's missing CPU backward is not reached)."""
    from gyre_hpc.trainer.base import tree_inputs
    from gyre_hpc.trainer.megatron_backend import PositionedRotary, build_model

    tree = pack_tree(forked_sequences(ModelConfig.load(tiny).vocab_size))
    t = megatron_tree
    blocky = build_model(t.model_config, t.layout, t.dtype, block_masks=True, recompute="full")
    blocky.rotary_pos_emb = PositionedRotary(blocky.rotary_pos_emb)
    blocky.load_state_dict(t.model.state_dict())
    t._emit_hidden(blocky.output_layer)
    blocky.train()
    ids, positions = tree_inputs(tree)
    blocky.rotary_pos_emb.positions = positions[0]
    mask = block_mask(tree.ends, torch.device("cpu"))
    with torch.no_grad():
        dense = t._forward(t._tree_unit(tree))
    with pytest.raises(TypeError, match="save_for_backward"):
        blocky(ids, positions, attention_mask=mask)
    blocky.tree_mask.mask = mask
    assert torch.allclose(blocky(ids, positions, attention_mask=None), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.megatron
def test_a_tree_padded_to_its_bucket_gives_the_same_step(megatron_tree, tiny: Path) -> None:  # noqa: ANN001
    """What a cell on CUDA does to bound its compiled lengths (here with the dense mask)."""
    seqs = forked_sequences(ModelConfig.load(tiny).vocab_size)
    t = megatron_tree
    t.zero_grad()
    plain = t.micro_step(seqs)
    g = t.gradient().copy()
    t.zero_grad()
    t.pad_trees = True
    try:
        padded = t.micro_step(seqs)
    finally:
        t.pad_trees = False
    assert padded.loss_sum == pytest.approx(plain.loss_sum, rel=1e-6)
    # Padded shapes reorder float32 sums (measured 1.03e-6 of the largest entry once); a pad token
    # that leaked into the loss would move the gradient by orders of magnitude more.
    assert np.abs(t.gradient() - g).max() <= 1e-5 * np.abs(g).max()
    t.zero_grad()


@pytest.mark.megatron
@pytest.mark.mpi
@pytest.mark.parametrize("case", TREES)
def test_a_megatron_tree_over_tensor_pipeline_or_data_parallel_ranks_gives_the_paths_step(
    case: str,
    megatron_cases,  # noqa: ANN001
) -> None:
    """The cases of ``megatron_worlds.TREES`` (in the world the other 2-rank cases share)."""
    where, tiny = megatron_cases(case)
    out = where / "parallel.npz"
    got = np.load(out)
    seqs = forked_sequences(ModelConfig.load(tiny).vocab_size)
    paths = TorchTrainer(tiny, CFG, core=True)
    stats = paths.micro_step(seqs)
    assert float(got["loss"]) == pytest.approx(stats.loss_sum, rel=1e-5)
    assert int(got["clipped"]) == stats.clipped
    # Whole-forest sharing on one stage; per-run trees as pipeline micro-batches or replica shares.
    assert int(got["tokens"]) < stats.tokens
    g = paths.gradient()
    assert np.abs(got["grad"] - g).max() <= 1e-5 * np.abs(g).max()
    paths.apply(3)
    assert np.abs(got["after"] - paths.weights()).max() < 1e-5


@pytest.mark.gpu
@pytest.mark.megatron
def test_on_cuda_a_megatron_tree_with_block_masks_gives_the_paths_step(tiny: Path) -> None:
    """FlexAttention forward and backward, which the CPU cannot run."""
    from gyre_hpc.trainer.megatron_backend import MegatronTrainer

    paths = MegatronTrainer(tiny, CFG, core=True)
    tree = MegatronTrainer(tiny, CFG, core=True, packing="tree")
    assert tree.device.type == "cuda"
    seqs = forked_sequences(ModelConfig.load(tiny).vocab_size)
    a, b = paths.micro_step(seqs), tree.micro_step(seqs)
    assert b.loss_sum == pytest.approx(a.loss_sum, rel=1e-4) and b.tokens < a.tokens
    ga, gb = paths.gradient(), tree.gradient()
    assert np.abs(gb - ga).max() <= 1e-4 * np.abs(ga).max()  # GPU kernels sum in other orders


@pytest.mark.gpu
def test_the_torch_trainer_on_a_gpu_takes_the_cpu_s_step(tiny: Path) -> None:
    """trainer.device = "cuda": its buffers live on the GPU, the host mirrors are written when
    asked, and the core's summed gradient is read back from the host. Adam's first step moves an
    element by lr · g / (|g| + eps): where |g| is within a few eps of 0 the devices' gradients,
    equal to 1e-4, can move it by up to lr on one and not the other, so weights are compared
    only where every gradient so far is well above eps, and everywhere within lr."""
    seqs = forked_sequences(ModelConfig.load(tiny).vocab_size)
    cpu, gpu = (TorchTrainer(tiny, CFG, core=True, device=d) for d in ("cpu", "cuda"))
    assert gpu.flat.is_cuda and not gpu.host_grad.is_cuda
    for t in (cpu, gpu):
        t.micro_step(seqs)
    g = cpu.gradient()
    assert np.abs(gpu.gradient() - g).max() <= 1e-4 * np.abs(g).max()
    steady = np.abs(g) > 1e-6  # 100 × Adam's eps: the gradients' relative error barely moves the step
    lr = CFG.lr

    def same(a: np.ndarray, b: np.ndarray) -> bool:
        return np.abs(a - b)[steady].max() < 1e-5 and np.abs(a - b).max() <= 2 * lr

    for t in (cpu, gpu):
        t.gradient()[:] *= 2  # as the core adds the other cells' gradients, on the host
        t.apply(3)
    assert same(gpu.weights(), cpu.weights())
    held = torch.cuda.memory_allocated()
    gpu.release_memory()  # while its cell samples
    assert torch.cuda.memory_allocated() < held / 4
    assert same(gpu.weights(), cpu.weights())
    gpu.resume_memory()
    for t in (cpu, gpu):
        t.zero_grad()
        t.micro_step(seqs)
        steady &= np.abs(t.gradient()) > 1e-6
        t.apply(3)
    assert same(gpu.weights(), cpu.weights())


def test_a_torch_trainer_whose_buffers_moved_trains_on_as_before(tiny: Path) -> None:
    """What ``release_memory``/``resume_memory`` do on a GPU, done by hand on the CPU: the flat
    buffers and Adam's moments move, the parameters follow them as views, the step is unchanged."""
    seqs = forked_sequences(ModelConfig.load(tiny).vocab_size)
    kept, moved = TorchTrainer(tiny, CFG, core=True), TorchTrainer(tiny, CFG, core=True)
    for t in (kept, moved):
        t.micro_step(seqs)
        t.apply(3)
    moved.offload.release(moved._resident())
    moved._point()
    moved.offload.resume(moved._resident(), moved.device)
    moved._point()
    first = next(moved.model.parameters())
    assert first.data_ptr() == moved.flat.data_ptr() and first.grad.data_ptr() == moved.grad.data_ptr()
    for t in (kept, moved):
        t.zero_grad()
        t.micro_step(seqs)
        t.apply(3)
    assert np.array_equal(moved.weights(), kept.weights())
