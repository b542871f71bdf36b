"""The warm start's settings (``builtin_models.warmstart``): what share of its demonstrations does
what, and for how many steps; and the fingerprint that names a cache built with them. Apart from
the warm start itself so that naming a cached model (every rank of every world does) imports no
torch and no agent client."""

RIGHT_FILE = 0.4  # share of demonstrations that write to answer.txt
WRONG_FILES = ["answer.md", "answers.txt", "out.txt"]
DELEGATE = 0.15  # share of episodes handed to a sub-agent: all four roles appear in rollouts
SUMMARY = 0.1  # share of episodes that also demonstrate a summary call
STEPS = 600  # 300 with delegation in the mix left the format too weak (6–14 % pass rate)
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The build's CPU kernels, whatever the CPU: torch, MKL and oneDNN otherwise pick them by the
machine's instruction set (AVX-512 here, AVX2 on another x86), and each rounds differently, so
two machines built different weights from one seed. Read when torch loads: the build runs in a
process of its own (``resolve``). On a CPU without AVX2 the build keeps the machine's kernels."""


def fingerprint() -> str:
    """Names a built warm-start: a cache built with other settings is not reused."""
    return f"r{RIGHT_FILE}-d{DELEGATE}-s{SUMMARY}-n{STEPS}-k{PINNED_KERNELS['ATEN_CPU_CAPABILITY']}"
