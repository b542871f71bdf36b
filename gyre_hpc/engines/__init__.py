"""Inference engines behind one HTTP contract: the SGLang-native API
(docs/ARCHITECTURE.md §6).

``embedded`` runs a Qwen3 model in torch on this machine; ``sglang`` launches the real server
on GPUs. ``client`` speaks to either, and cannot tell them apart.
"""
