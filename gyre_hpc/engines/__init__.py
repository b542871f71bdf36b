"""Inference engines behind one HTTP contract: the SGLang-native API
(docs/ARCHITECTURE.md §6).

``embedded`` runs a model of any supported family in torch on this machine; ``sglang`` launches
the real server on GPUs. ``client`` speaks to either, and cannot tell them apart.
"""
