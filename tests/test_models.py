"""The tiny model and the Qwen3 implementation: offline, deterministic, equal to transformers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.models.tokenizer import ChatTokenizer


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_init_tiny_is_a_standard_directory_identical_for_a_seed(tiny: Path, tmp_path: Path) -> None:
    assert set(digests(tiny)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    assert digests(init_tiny(tmp_path / "again", seed=0)) == digests(tiny)
    other = digests(init_tiny(tmp_path / "other", seed=1))
    assert other["model.safetensors"] != digests(tiny)["model.safetensors"]
    assert other["tokenizer.json"] == digests(tiny)["tokenizer.json"]


def test_logits_equal_transformers_qwen3(tiny: Path) -> None:
    import transformers  # a test tool (pip install -e '.[test]')

    ours = CausalLM.from_pretrained(tiny)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], theirs(ids).logits, rtol=1e-5, atol=1e-5)


def test_incremental_keys_values_equal_the_full_pass(tiny: Path) -> None:
    model = CausalLM.from_pretrained(tiny)
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(ids)
        head, kv = model(ids[:, :17])
        tail, _ = model(ids[:, 17:], past=kv)
    torch.testing.assert_close(torch.cat([head, tail], 1), full, rtol=1e-4, atol=1e-5)


def test_chat_template_with_tools_matches_transformers(tiny: Path) -> None:
    import transformers

    messages = [
        {"role": "system", "content": "You write code."},
        {"role": "user", "content": "Add two numbers."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "write_file", "arguments": '{"path": "a.py", "content": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]
    ours = ChatTokenizer(tiny)
    text = ours.render(messages, tools)
    assert (
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "content": "x"}}\n</tool_call>'
        in text
    )
    assert text.endswith("<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    hf = transformers.AutoTokenizer.from_pretrained(tiny)
    assert hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True) == text
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode(text)) == text
