"""The warm start's settings (``builtin_models.warmstart``): what share of its demonstrations does
what, and for how many steps; and the fingerprint that names a cache built with them. Apart from
the warm start itself so that naming a cached model (every rank of every world does) imports no
torch and no agent client."""

RIGHT_FILE = 0.4  # share of demonstrations that write to answer.txt
WRONG_FILES = ["answer.md", "answers.txt", "out.txt"]
DELEGATE = 0.15  # share of episodes handed to a sub-agent: all four roles appear in rollouts
SUMMARY = 0.1  # share of episodes that also demonstrate a summary call
STEPS = 600  # 300 with delegation in the mix left the format too weak (6–14 % pass rate)


def fingerprint() -> str:
    """Names a built warm-start: a cache built with other settings is not reused."""
    return f"r{RIGHT_FILE}-d{DELEGATE}-s{SUMMARY}-n{STEPS}"
