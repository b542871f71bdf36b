"""Models: the families run (transformers' implementations), their configs, tokenizers and chat
templates, the flat weight layout, GGUF files read, the tiny model."""
