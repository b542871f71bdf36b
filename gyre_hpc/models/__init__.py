"""Models: the Qwen3 architecture in plain torch, its tokenizer and chat template, the tiny model."""
