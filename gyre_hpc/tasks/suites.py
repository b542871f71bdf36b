"""Built-in task suites, generated deterministically from a seed; and the suite registry.

- ``repo-mini``: build a small multi-file Python package from a spec; hidden checks (each call's
  value compared, types included); partial score = fraction passing. ``repo-mini-long`` asks
  for dozens of functions.
- ``terminal-mini``: multi-step shell / configuration tasks checked on the end state, with
  milestones for partial credit.
- ``smoke``: one-file tasks sized so the tiny CPU model can learn them.
- ``plural``: English plurals answered in one reply, no tools: what a small pretrained chat
  model (SmolLM2-135M, ``recipes/smollm2.toml``) partly answers.
- ``emulated``: placeholder prompts scored by a seeded coin, for emulated-GPU runs that measure
  the schedule (the emulated engine does not read the prompt).

``split="heldout"`` draws from a separate random stream, so evaluation tasks are not the
training tasks.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from gyre_hpc.errors import GyreError
from gyre_hpc.tasks.jsonl import load_jsonl
from gyre_hpc.tasks.task import Task

# name, parameters, what it does, hidden checks: (call, expected value as a Python literal); the
# first one is also the visible test
FUNCTIONS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    (
        "add",
        "a, b",
        "returns a + b",
        [("add(2, 3)", "5"), ("add(-1, 1)", "0"), ("add(0, 0)", "0")],
    ),
    (
        "sub",
        "a, b",
        "returns a - b",
        [("sub(5, 3)", "2"), ("sub(0, 4)", "-4")],
    ),
    (
        "mul",
        "a, b",
        "returns a * b",
        [("mul(2, 3)", "6"), ("mul(-2, 4)", "-8")],
    ),
    (
        "clamp",
        "x, lo, hi",
        "returns x limited to the range [lo, hi]",
        [("clamp(5, 0, 3)", "3"), ("clamp(-1, 0, 3)", "0"), ("clamp(2, 0, 3)", "2")],
    ),
    (
        "is_prime",
        "n",
        "returns True when n is a prime number",
        [
            ("is_prime(7)", "True"),
            ("is_prime(8)", "False"),
            ("is_prime(1)", "False"),
            ("is_prime(2)", "True"),
        ],
    ),
    (
        "fib",
        "n",
        "returns the n-th Fibonacci number, fib(0) == 0 and fib(1) == 1",
        [("fib(0)", "0"), ("fib(1)", "1"), ("fib(10)", "55")],
    ),
    (
        "factorial",
        "n",
        "returns n!",
        [("factorial(0)", "1"), ("factorial(5)", "120")],
    ),
    (
        "gcd",
        "a, b",
        "returns the greatest common divisor",
        [("gcd(12, 18)", "6"), ("gcd(7, 5)", "1")],
    ),
    (
        "reverse_words",
        "s",
        "returns the words of s in reverse order joined by single spaces",
        [("reverse_words('a b c')", "'c b a'"), ("reverse_words('hi')", "'hi'")],
    ),
    (
        "count_vowels",
        "s",
        "returns how many of the letters of s are vowels (aeiou, any case)",
        [("count_vowels('hello')", "2"), ("count_vowels('AEIOU')", "5"), ("count_vowels('xyz')", "0")],
    ),
    (
        "is_palindrome",
        "s",
        "returns True when s reads the same backwards, ignoring case",
        [("is_palindrome('Level')", "True"), ("is_palindrome('abc')", "False")],
    ),
    (
        "flatten",
        "xs",
        "flattens one level of nesting of a list of lists",
        [("flatten([[1, 2], [3]])", "[1, 2, 3]"), ("flatten([])", "[]")],
    ),
    (
        "chunk",
        "xs, n",
        "splits the list xs into consecutive lists of length n (the last may be shorter)",
        [("chunk([1, 2, 3], 2)", "[[1, 2], [3]]"), ("chunk([], 3)", "[]")],
    ),
    (
        "dedupe",
        "xs",
        "removes repeated items, keeping the first of each",
        [("dedupe([1, 2, 1, 3, 2])", "[1, 2, 3]"), ("dedupe([])", "[]")],
    ),
    (
        "mean",
        "xs",
        "returns the arithmetic mean of a non-empty list",
        [("mean([1, 2, 3])", "2"), ("mean([4])", "4")],
    ),
    (
        "word_count",
        "s",
        "returns a dict mapping each word of s to how often it occurs",
        [("word_count('a b a')", "{'a': 2, 'b': 1}"), ("word_count('')", "{}")],
    ),
    (
        "caesar",
        "s, k",
        "shifts every lower-case letter of s by k places in the alphabet, wrapping around",
        [("caesar('abc', 1)", "'bcd'"), ("caesar('xyz', 3)", "'abc'")],
    ),
    (
        "to_snake",
        "s",
        "converts CamelCase to snake_case",
        [("to_snake('HelloWorld')", "'hello_world'"), ("to_snake('A')", "'a'")],
    ),
    (
        "running_sum",
        "xs",
        "returns the list of prefix sums of xs",
        [("running_sum([1, 2, 3])", "[1, 3, 6]"), ("running_sum([])", "[]")],
    ),
    (
        "maximum",
        "xs",
        "returns the largest item of a non-empty list without using max()",
        [("maximum([3, 9, 2])", "9"), ("maximum([-5])", "-5")],
    ),
]


def repo_mini(n: int, seed: int, size: tuple[int, int] = (2, 6)) -> list[Task]:
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        chosen = rng.sample(FUNCTIONS, min(rng.randint(*size), len(FUNCTIONS)))
        modules: dict[str, list] = {}
        for j, fn in enumerate(chosen):
            modules.setdefault(f"part{j // 4}", []).append(fn)
        lines = [
            f"Create a Python package `pkg{i}` (a directory pkg{i}/ with __init__.py) with these modules:"
        ]
        checks, visible = [], {}
        for mod, fns in modules.items():
            lines.append(
                f"- pkg{i}/{mod}.py: "
                + "; ".join(f"{name}({params}) {what}" for name, params, what, _ in fns)
            )
            # Checks, not pytest files: each value is compared outside the sandbox, types included.
            checks += [
                {"module": f"pkg{i}.{mod}", "call": call, "expect": expect}
                for _, _, _, cases in fns
                for call, expect in cases
            ]
            visible[f"test_{mod}.py"] = "\n\n".join(
                f"def test_{name}():\n    from pkg{i}.{mod} import {name}\n"
                f"    assert {_assertion(*cases[0])}\n"
                for name, _, _, cases in fns
            )
        lines.append("Run the visible tests with run_tests, then call finish.")
        tasks.append(
            Task(
                id=f"repo-mini-{seed}-{i}",
                spec="\n".join(lines),
                scorer="hidden-tests",
                hidden_checks=checks,
                visible_tests=visible,
            )
        )
    return tasks


def _assertion(call: str, expect: str) -> str:
    """A check as a visible test's assertion."""
    if expect in ("True", "False"):
        return call if expect == "True" else f"not {call}"
    return f"{call} == {expect}"


def terminal_mini(n: int, seed: int) -> list[Task]:
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        d, port, word = f"srv{rng.randint(1, 99)}", rng.choice([8080, 8443, 9000, 5432]), rng.choice(WORDS)
        spec = (
            f"Set up a service directory: create {d}/config/app.ini containing the line `port = {port}`, "
            f"create {d}/run.sh that prints `{word}` and make it executable, create {d}/logs/ "
            f"and write the number of files in {d}/config into {d}/logs/count.txt. Then call finish."
        )
        milestones = [
            {"weight": 1, "file_exists": f"{d}/config/app.ini"},
            {"weight": 2, "file_contains": [f"{d}/config/app.ini", f"port = {port}"]},
            {"weight": 1, "command": f"test -x {d}/run.sh"},
            {"weight": 2, "command": f"bash {d}/run.sh | grep -qx {word}"},
            {"weight": 2, "file_contains": [f"{d}/logs/count.txt", "1"]},
        ]
        tasks.append(
            Task(id=f"terminal-mini-{seed}-{i}", spec=spec, scorer="milestones", milestones=milestones)
        )
    return tasks


WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "maple",
    "ocean",
    "piano",
    "lemon",
    "robot",
    "candle",
    "forest",
    "silver",
    "planet",
    "garden",
    "window",
    "rocket",
    "bridge",
    "castle",
    "pepper",
]


SMOKE_PHRASINGS = [
    "Write the word done to answer.txt, then call finish.",
    "Put the word done into the file answer.txt and call finish.",
    "Create answer.txt containing the word done, then call finish.",
    "The file answer.txt must contain the word done. Call finish afterwards.",
]


def smoke(n: int, seed: int) -> list[Task]:
    """Write ``done`` to answer.txt, phrased four ways: what a ~1M-parameter model can learn on a CPU.

    (Copying a word chosen by the prompt into the tool call proved too hard for the tiny model
    in minutes of training; choosing the right file is what RL improves here.)
    """
    rng = random.Random(seed)
    return [
        Task(
            id=f"smoke-{seed}-{i}",
            spec=rng.choice(SMOKE_PHRASINGS),
            scorer="milestones",
            milestones=[
                {"weight": 1, "file_exists": "answer.txt"},
                {"weight": 3, "command": "grep -qx done answer.txt"},
            ],
        )
        for i in range(n)
    ]


PLURALS = {
    "apple": "apples", "river": "rivers", "stone": "stones", "cloud": "clouds", "tiger": "tigers",
    "ocean": "oceans", "piano": "pianos", "lemon": "lemons", "robot": "robots", "candle": "candles",
    "forest": "forests", "planet": "planets", "garden": "gardens", "window": "windows",
    "bridge": "bridges", "castle": "castles", "box": "boxes", "bus": "buses", "church": "churches",
    "dish": "dishes", "fox": "foxes", "glass": "glasses", "city": "cities", "baby": "babies",
    "party": "parties", "story": "stories", "knife": "knives", "leaf": "leaves", "wolf": "wolves",
    "life": "lives", "shelf": "shelves", "potato": "potatoes", "tomato": "tomatoes", "hero": "heroes",
    "child": "children", "man": "men", "woman": "women", "tooth": "teeth", "foot": "feet",
    "mouse": "mice", "goose": "geese", "person": "people", "ox": "oxen", "cactus": "cacti",
    "sheep": "sheep", "deer": "deer", "fish": "fish", "key": "keys", "day": "days", "toy": "toys",
}  # fmt: skip
PLURAL_PHRASINGS = [
    "What is the plural of {w}? Answer with one word.",
    "Give the plural form of the word {w}. Reply with the word only.",
    "One {w}, two what? Answer with one word.",
]


def plural(n: int, seed: int) -> list[Task]:
    """English plurals asked in one reply, no tools (``answers``, the reply scorer): what a small
    pretrained chat model (SmolLM2-135M) partly answers ("The plural of wolf is wolves." but
    also "The plural of ocean is oaths."), irregular nouns most often wrong."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        word = rng.choice(sorted(PLURALS))
        spec = rng.choice(PLURAL_PHRASINGS).format(w=word)
        tasks.append(Task(id=f"plural-{seed}-{i}", spec=spec, scorer="reply", answers=[PLURALS[word]]))
    return tasks


def emulated(n: int, seed: int) -> list[Task]:
    """Prompts for emulated runs: the reply length is the emulated engine's, the reward a coin."""
    return [
        Task(id=f"emulated-{seed}-{i}", spec=f"Emulated task {i}. Call finish.", scorer="coin")
        for i in range(n)
    ]


SUITES: dict[str, Callable[[int, int], list[Task]]] = {
    "smoke": smoke,
    "repo-mini": repo_mini,
    "repo-mini-long": lambda n, seed: repo_mini(n, seed, size=(16, 20)),
    "terminal-mini": terminal_mini,
    "emulated": emulated,
    "plural": plural,
}
HELDOUT_OFFSET = 1_000_003


def load_suite(name: str, n: int, seed: int = 0, split: str = "train") -> list[Task]:
    """``n`` tasks of a built-in suite (train or held-out split), or of a JSONL file (all if n ≤ 0)."""
    if name in SUITES:
        return SUITES[name](n, seed + (HELDOUT_OFFSET if split == "heldout" else 0))
    if Path(name).is_dir():
        from gyre_hpc.tasks.harbor import load_dir

        tasks = load_dir(name)
        return tasks if n <= 0 else tasks[:n]
    if name.endswith(".jsonl") or Path(name).exists():
        tasks = load_jsonl(name)
        return tasks if n <= 0 else tasks[:n]
    raise GyreError(
        f"tasks.suite = {name!r} is neither a built-in suite ({', '.join(SUITES)}), a JSONL file nor a "
        "directory of Harbor tasks"
    )


def find_task(suite: str, seed: int, task_id: str) -> Task:
    """The task of ``suite`` named ``task_id``: a built-in suite's task is rebuilt from the seed
    and index its id ends with (``smoke-7-3``: the fourth of seed 7, whichever step or split drew
    it); a file's or directory's is looked up."""
    if suite in SUITES:
        if (m := re.fullmatch(r".*-(\d+)-(\d{1,5})", task_id)) is not None:  # an index a step can draw
            made = SUITES[suite](int(m[2]) + 1, int(m[1]))
            if made and made[-1].id == task_id:
                return made[-1]
        tasks = load_suite(suite, 3, seed)
        example = f"ids end with the seed and index, e.g. {tasks[0].id}"
    else:
        tasks = load_suite(suite, 0)
        for t in tasks:
            if t.id == task_id:
                return t
        example = f"e.g. {', '.join(t.id for t in tasks[:3])}"
    raise GyreError(f"--task {task_id}: no such task in tasks.suite = {suite!r}; {example}")


def private_paths(suite: str) -> list[Path]:
    """What of a suite no execution may see: a JSONL file itself, the directories its hidden tests
    are read from and the repositories its SWE instances are seeded from (their later commits
    hold the fixes); a Harbor directory whole (its tests and solutions). Nothing for a built-in
    suite's name."""
    path = Path(suite)
    if path.is_dir():
        return [path.resolve()]
    if not path.is_file():
        return []
    dirs = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue  # load_jsonl names the line
        spec = d.get("hidden_tests") if isinstance(d, dict) else None
        if isinstance(spec, dict) and isinstance(spec.get("dir"), str):
            dirs.append((path.parent / spec["dir"]).resolve())
        repo = d.get("repo") if isinstance(d, dict) and "instance_id" in d else None
        if isinstance(repo, str) and (path.parent / repo).exists():
            dirs.append((path.parent / repo).resolve())
    return [path.resolve(), *dict.fromkeys(dirs)]
