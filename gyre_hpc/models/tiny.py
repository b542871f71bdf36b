"""The tiny offline model: a few-layer Qwen3 (or any family's) with random weights and a locally trained
tokenizer.

``init_tiny(dir, seed, words)`` writes a standard Hugging Face model directory — ``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja`` — in seconds on a CPU with no network, identical for a given seed.
The byte-level BPE is trained on a small built-in corpus of code, prose and tool calls.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.catalog import VOCAB_SIZE, tiny_config
from gyre_hpc.models.causal_lm import CausalLM, save_weights

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()

_CORPUS = [
    "You are a helpful coding agent. Read the spec, write the package, run the tests, and finish.",
    "The user asks you to implement a small Python package from a natural-language specification.",
    "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n",
    "import os\nimport sys\nfrom pathlib import Path\n\n\nclass Stack:\n",
    "    def __init__(self):\n        self.items = []\n",
    "    def push(self, item):\n        self.items.append(item)\n",
    "    def pop(self):\n        return self.items.pop()\n",
    'for i in range(10):\n    if i % 2 == 0:\n        print(f"{i} is even")\n    else:\n        continue\n',
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "calc/ops.py", "content": "def add(a, b):"}}\n'
    "</tool_call>",
    '<tool_call>\n{"name": "run_shell", "arguments": {"command": "python -m pytest -q"}}\n</tool_call>',
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>',
    '<tool_call>\n{"name": "finish", "arguments": {"summary": "All tests pass."}}\n</tool_call>',
    "<tool_response>\n4 passed in 0.01s\n</tool_response>",
    "<tool_response>\nFAILED tests/test_ops.py::test_mul - AssertionError: assert 5 == 6\n</tool_response>",
    "mkdir -p /srv/app && echo 'port = 8080' > /srv/app/app.conf && chmod +x run.sh && ls -la",
    "Summary of progress so far: the package layout exists, two of four functions pass their tests.",
    "The quick brown fox jumps over the lazy dog. 0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
]


def train_tokenizer(words: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE of the built-in corpus; each of ``words`` (a suite's vocabulary) becomes
    one token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # A suite's words become single tokens: copying one token is what the tiny model can learn.
    corpus = _CORPUS * 8 + [TEMPLATE] + [" ".join(words), " ".join(f'"{w}"' for w in words)] * 64
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def init_tiny(model_dir: str | Path, seed: int = 0, words: Sequence[str] = (), family: str = "qwen3") -> Path:
    """``words``: a task suite's vocabulary the tokenizer keeps whole (the built-ins pass the
    smoke suite's; this module knows no suite). ``family``: any of ``catalog.TINY_FAMILIES``, the
    same tokenizer and chat template for each."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(words)
    tok.save(str(model_dir / "tokenizer.json"))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    config = tiny_config(tok.get_vocab_size(), eos, family)
    save_weights(random_model(config, seed), model_dir / "model.safetensors")
    (model_dir / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": config.max_position_embeddings,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )
    return model_dir


def random_model(config: ModelConfig, seed: int) -> CausalLM:
    """``config``'s model with every matrix drawn from N(0, 0.02), norms one and biases zero: the
    same weights for the same config and seed, on any machine."""
    model = CausalLM(config, init=False)
    torch.manual_seed(seed)
    _advance_as_first_built(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    return model


def _advance_as_first_built(c: ModelConfig) -> None:
    """Advance the generator as torch's default initialisation of the first tiny model's modules
    did before its matrices were drawn, so that a seed still names the model it always named."""
    h, q, kv, f = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    )
    torch.empty(c.vocab_size, h).normal_()
    for _ in range(c.num_hidden_layers):
        for rows, cols in ((q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)):
            torch.nn.init.kaiming_uniform_(torch.empty(rows, cols), a=math.sqrt(5))
    torch.nn.init.kaiming_uniform_(torch.empty(c.vocab_size, h), a=math.sqrt(5))
