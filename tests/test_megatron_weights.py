"""A model's weights between the Hugging Face and Megatron layouts: exact round trips for every
TP × PP cut and every family (routed experts included), Megatron's fused orders, and one read
per source tensor."""

from __future__ import annotations

import pytest
import torch

from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.family import FAMILIES
from gyre_hpc.models.flat import FlatLayout, joined
from gyre_hpc.trainer.megatron_weights import MegatronLayout, hf_to_megatron, is_expert, megatron_to_hf


def config(tie: bool, family: str = "qwen3") -> ModelConfig:
    return ModelConfig(
        model_type=family,
        vocab_size=300,  # not a multiple of 128 · tp: Megatron's padding is exercised
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tie,
        **(
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 24 if family == "qwen3_moe" else 48,
            }
            if FAMILIES[family].experts
            else {}
        ),
    )


def hf_state(c: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = CausalLM(c)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def to_megatron(
    state: dict[str, torch.Tensor], layout: MegatronLayout
) -> dict[int, list[dict[str, torch.Tensor]]]:
    return {
        s: [dict(hf_to_megatron(state.__getitem__, layout, r, s)) for r in range(layout.tp)]
        for s in range(layout.pp)
    }


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "qwen3_moe", "mixtral"])  # mistral: llama's
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_to_megatron_to_hf_is_bit_identical(tie: bool, tp: int, pp: int, family: str) -> None:
    c = config(tie, family)
    state = hf_state(c)
    layout = MegatronLayout(c, tp=tp, pp=pp)
    shards = to_megatron(state, layout)
    back: dict[str, torch.Tensor] = {}
    for s in range(pp):
        # a routed expert's tensor from every expert-parallel rank (one here), the rest from every TP rank
        read = lambda name, s=s: [shards[s][r][name] for r in range(1 if is_expert(name) else tp)]  # noqa: E731
        back.update(joined(megatron_to_hf(read, layout, s), c.num_experts))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_megatron_shapes_and_fused_orders() -> None:
    c = config(tie=False)
    state = hf_state(c)
    layout = MegatronLayout(c, tp=2)
    r0, r1 = to_megatron(state, layout)[0]
    d = c.head_dim
    qkv = r0["decoder.layers.0.self_attention.linear_qkv.weight"]
    # One query group per rank here: its 2 q heads, then its k head, then its v head.
    assert qkv.shape == ((c.num_attention_heads + 2 * c.num_key_value_heads) * d // 2, c.hidden_size)
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(qkv[: 2 * d], q[: 2 * d])
    assert torch.equal(qkv[2 * d : 3 * d], k[:d]) and torch.equal(qkv[3 * d :], v[:d])
    qkv1 = r1["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(qkv1[2 * d : 3 * d], k[d:])
    fc1 = r1["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[24:], up[24:]]))  # each rank: [its gate rows | its up rows]
    assert r0["decoder.layers.0.self_attention.linear_proj.weight"].shape == (c.hidden_size, 16)
    emb = r1["embedding.word_embeddings.weight"]
    assert layout.padded_vocab == 512 and emb.shape == (256, c.hidden_size)
    assert torch.equal(emb[: 300 - 256], state["model.embed_tokens.weight"][256:])
    assert not emb[300 - 256 :].any()  # padding rows are zero


def test_each_source_tensor_is_read_once_per_rank() -> None:
    c = config(tie=False)
    state = hf_state(c)
    reads: list[str] = []
    for _ in hf_to_megatron(lambda n: reads.append(n) or state[n], MegatronLayout(c, tp=2), 0, 0):
        pass
    assert sorted(reads) == sorted(state)


def test_a_cut_that_does_not_divide_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor parallel size 3 must divide the 4 attention heads"):
        MegatronLayout(config(tie=False), tp=3)
    with pytest.raises(ValueError, match="pipeline size 3 must divide the 4 layers"):
        MegatronLayout(config(tie=False), pp=3)


def test_a_tied_embedding_is_copied_to_the_last_stage_as_its_output_layer() -> None:
    c = config(tie=True)
    state = hf_state(c)
    shards = to_megatron(state, MegatronLayout(c, tp=2, pp=2))
    for r in range(2):
        first, last = shards[0][r], shards[1][r]
        assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    assert "output_layer.weight" not in to_megatron(state, MegatronLayout(c, tp=2))[0][0]  # one stage: shared


def test_every_hugging_face_tensor_has_one_stage() -> None:
    c = config(tie=False)
    state = hf_state(c)
    layout = MegatronLayout(c, pp=2)
    shards = to_megatron(state, layout)
    held = {s: {n for n, _ in megatron_to_hf(lambda n, s=s: [shards[s][0][n]], layout, s)} for s in range(2)}
    assert all(layout.stage_of(name) == s for s, names in held.items() for name in names)
    assert held[0] | held[1] == set(state) and not held[0] & held[1]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize(("tp", "pp", "ep"), [(1, 1, 2), (2, 1, 2), (1, 2, 4), (2, 2, 2)])
def test_experts_split_over_expert_parallel_ranks_and_join_back_bit_identical(
    family: str, tp: int, pp: int, ep: int
) -> None:
    c = config(False, family)
    state = hf_state(c)
    layout = MegatronLayout(c, tp=tp, pp=pp, ep=ep)
    shards = {
        s: {
            (r, e): dict(hf_to_megatron(state.__getitem__, layout, r, s, e))
            for r in range(tp)
            for e in range(ep)
        }
        for s in range(pp)
    }
    back: dict[str, torch.Tensor] = {}
    for s in range(pp):

        def read(name: str, s: int = s) -> list[torch.Tensor]:
            if is_expert(name):
                return [shards[s][(0, e)][name] for e in range(ep)]
            return [shards[s][(r, 0)][name] for r in range(tp)]

        back.update(joined(megatron_to_hf(read, layout, s), c.num_experts))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    # A rank holds its own experts alone: expert-parallel rank e's j-th is the layer's e·E/ep + j-th.
    per = c.num_experts // ep
    mine = shards[pp - 1][(tp - 1, ep - 1)]
    held = [n for n in mine if is_expert(n) and n.endswith("linear_fc2.weight")]
    assert len(held) == c.num_hidden_layers // pp * per
    last = c.num_hidden_layers - 1
    down = state[f"model.layers.{last}.mlp.experts.down_proj"]
    layer = f"decoder.layers.{c.num_hidden_layers // pp - 1}.mlp.experts.local_experts."
    assert all(
        torch.equal(mine[f"{layer}{j}.linear_fc2.weight"], down[(ep - 1) * per + j]) for j in range(per)
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_stream_of_experts_one_at_a_time_is_the_checkpoint_s_tensors(family: str) -> None:
    """What a megatron replica streams (a layer's fused experts an expert at a time, so no rank
    gathers a whole layer's) names exactly what transformers saves once turned into the
    checkpoint's tensors (what SGLang loads and exports write)."""
    c = config(False, family)
    state, layout = hf_state(c), MegatronLayout(c, tp=2, pp=1, ep=2)
    flat = FlatLayout.of(c)
    shards = {
        (r, e): dict(hf_to_megatron(state.__getitem__, layout, r, 0, e)) for r in range(2) for e in range(2)
    }

    def read(name: str) -> list[torch.Tensor]:
        return (
            [shards[(0, e)][name] for e in range(2)]
            if is_expert(name)
            else [shards[(r, 0)][name] for r in range(2)]
        )

    stream = list(megatron_to_hf(read, layout, 0))
    expert = flat.slots["model.layers.0.mlp.experts.gate_up_proj"][1][1:].numel()
    assert max(t.numel() for name, t in stream if "experts" in name) == expert
    got = dict(flat.as_checkpoint(stream))
    want = flat.checkpoint_tensors(torch.cat([state[n].reshape(-1) for n in flat.slots]))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
