"""Hardware, service and package needs are pytest markers (``CAPABILITIES``, in setup.cfg).

Plain ``pytest`` runs everything this machine can run and skips the rest, saying why. Where a
capability must be there (``tools/test.sh``, which CI calls, sets ``GYRE_REQUIRE``), its absence
fails the run instead of hiding behind skips. A test that finds a capability missing only once it
runs (``missing``) follows the same rule: no test skips by itself.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CAPABILITIES = (
    "mpi", "slurm", "gpu", "rdma", "megatron", "sglang", "agents", "bwrap", "image", "root",
    "cgroups", "seccomp",
)  # fmt: skip
SGLANG_PYTHON = Path(os.environ.get("GYRE_SGLANG_PYTHON") or REPO / ".venv-sglang" / "bin" / "python")
"""The environment ``tools/setup.sh --sglang`` builds: SGLang and this package, side by side
(GYRE_SGLANG_PYTHON: another Python with both, e.g. on a GPU machine)."""
MINI_SWE_AGENT = REPO / ".venv-agents" / "bin" / "mini"
IMAGES = Path(os.environ.get("GYRE_IMAGE_CACHE") or Path.home() / ".cache" / "gyre-hpc" / "images")
TEST_IMAGE = IMAGES / "test-bookworm-tree"
"""A Debian root filesystem holding ``tree``, which the host lacks (``tools/setup.sh --test``)."""
"""mini-swe-agent, in the environment ``tools/setup.sh --agents`` builds."""


@functools.cache
def why_missing(capability: str) -> str | None:
    """None when this machine has ``capability``, else the reason it does not."""
    if capability == "mpi":
        if shutil.which("mpirun") is None:
            return "mpirun not found (apt install openmpi-bin)"
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py not installed"
        return None
    if capability == "slurm":
        if shutil.which("sinfo") is None:
            return "Slurm not installed (tools/setup.sh)"
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
        nodes = [line for line in out.stdout.splitlines() if line.split()[-1] in ("idle", "mix", "alloc")]
        if out.returncode or len(nodes) < 3:
            return "no running Slurm with 3 usable nodes (tools/local_slurm.sh start)"
        return None
    if capability == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            return "megatron-core not installed (pip install -e '.[megatron]')"
        return None
    if capability == "sglang":
        if not SGLANG_PYTHON.exists():
            return "no SGLang environment (bash tools/setup.sh --sglang)"
        probe = subprocess.run(
            [str(SGLANG_PYTHON), "-c", "import gyre_hpc, sglang.launch_server"], capture_output=True
        )
        return None if probe.returncode == 0 else f"{SGLANG_PYTHON} cannot import sglang"
    if capability == "agents":
        return None if MINI_SWE_AGENT.exists() else "no agent programs (bash tools/setup.sh --agents)"
    if capability == "bwrap":
        from gyre_hpc.sandbox.confine import Sandbox

        return Sandbox("bwrap").problem()
    if capability == "image":
        if not (TEST_IMAGE / "usr" / "bin" / "tree").exists():
            return f"no test image at {TEST_IMAGE} (bash tools/setup.sh --test)"
        return why_missing("bwrap")
    if capability == "root":
        if os.geteuid() != 0:
            return "not root (mounting a tmpfs needs it)"
        return None if shutil.which("mount") else "mount not found"
    if capability == "cgroups":
        from gyre_hpc.sandbox.limits import Limits, choose

        groups, note = choose("auto", Limits())
        return None if groups.kind in ("cgroup-v1", "cgroup-v2") else f"no writable cgroups here ({note})"
    if capability == "seccomp":
        from gyre_hpc.sandbox import seccomp

        return seccomp.problem()
    if capability == "gpu":
        return None if torch.cuda.is_available() else "no CUDA GPU"
    if capability == "rdma":
        try:
            from pyverbs.device import get_device_list

            return None if get_device_list() else "no RDMA device"
        except Exception as err:  # pyverbs raises when the kernel has no RDMA subsystem at all
            return f"no RDMA ({type(err).__name__})"
    raise ValueError(capability)


def required() -> set[str]:
    """The capabilities ``GYRE_REQUIRE`` names: their absence is an error, not a skip."""
    return {c for c in os.environ.get("GYRE_REQUIRE", "").split(",") if c}


def missing(capability: str, why: str) -> NoReturn:
    """A test found ``capability`` missing as it ran: a failure where ``GYRE_REQUIRE`` names it, a
    skip saying why elsewhere (the markers' rule, for what only the test itself can find out)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"{capability} is not a capability; valid: {', '.join(CAPABILITIES)}")
    if capability in required():
        pytest.fail(f"GYRE_REQUIRE includes {capability}, but {why}", pytrace=False)
    pytest.skip(why)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    required_here = required()
    for capability in sorted(required_here):
        if (why := why_missing(capability)) is not None:
            raise pytest.UsageError(f"GYRE_REQUIRE includes {capability}, but {why}")
    for item in items:
        for capability in CAPABILITIES:
            if capability in item.keywords and (why := why_missing(capability)) is not None:
                item.add_marker(pytest.mark.skip(reason=why))


def gyre(*args: str, cwd: Path | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
    """Run the real ``gyre-hpc`` command line in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "gyre_hpc", *args],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        timeout=timeout,
        **kw,
    )


GOLDEN = REPO / "tests" / "golden"


def assert_golden(name: str, text: str) -> None:
    """``text`` equals ``tests/golden/<name>``; ``GYRE_UPDATE_GOLDEN=1`` rewrites the file instead."""
    path = GOLDEN / name
    if os.environ.get("GYRE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; GYRE_UPDATE_GOLDEN=1 rewrites it"


def recomputed(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    """Log-probs of ``output`` after ``prompt`` under ``model`` (a CausalLM), computed here."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0][0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def flat_of(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters in registration order, tied ones once: the flat layout, derived
    here independently of ``models.flat``."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture(scope="session")
def megatron_cases(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """``megatron_worlds.CASES`` the selected tests ask for (their ``case`` parameter), run once,
    all on the first ask: a function, case id → (its directory, its model)."""
    from megatron_worlds import CASES, run_cases

    params = [getattr(getattr(item, "callspec", None), "params", {}) for item in request.session.items]
    wanted = sorted({p["case"] for p in params if p.get("case") in CASES})
    ran: dict = {}

    def case(case_id: str) -> tuple[Path, Path]:
        if not ran:
            try:
                ran.update(run_cases(wanted, tmp_path_factory.mktemp("megatron-worlds")))
            except RuntimeError as err:
                ran.update(dict.fromkeys(wanted, err))
        if isinstance(ran[case_id], RuntimeError):
            raise ran[case_id]
        return ran[case_id]

    return case


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained to answer every turn with a tool call (built once per session)."""
    from loopback import tool_calling_model

    return tool_calling_model(tmp_path_factory.mktemp("models") / "tools")


# ---- finished runs that several tests read ---------------------------------------------------------
# A whole run is the suite's dearest part (an MPI world, the model, its steps). Tests that only read
# what a run left share one, built once per session, with the overrides below.

SMOKE = str(REPO / "recipes" / "smoke.toml")
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
NO_EVAL = "tasks.eval_every=0"
"""The smoke recipe evaluates 32 held-out tasks before step 1 (~10 s of a short run); the runs that
do not test evaluation skip it (``ELASTIC`` and test_tracking do)."""
COLOCATE = ("run.steps=3", "trainer.checkpoint_every=100", NO_EVAL)
"""The smoke recipe as shipped (colocate, the warm-started tiny model) without its evaluation: 3
steps, one checkpoint, at the end. The world and its shutdown (test_local_run), colocate's
training (test_rl_loop), and the straight run a preempted Slurm job must match step for step
(test_slurm_faults) read it."""
ELASTIC = (
    "run.steps=2", "scheduler.mode=elastic", "cells.count=3", "tasks.prompts_per_step=4",
    "tasks.eval_every=1", "tasks.eval_n=4", "observability.wandb_project=gyre-test",
)  # fmt: skip
"""Elastic, 3 cells, 2 steps, held-out evaluations before and after each step, TensorBoard and an
offline W&B run: elastic's switches (test_rl_loop) and what a run records (test_tracking)."""


def run_smoke(runs_dir: Path, sets: tuple[str, ...] | list[str], timeout: float = 900) -> Path:
    """``gyre-hpc run recipes/smoke.toml`` with these overrides into ``runs_dir``; its directory."""
    args = [a for s in (f"run.runs_dir={runs_dir}", *sets) for a in ("--set", s)]
    proc = gyre("run", SMOKE, *args, timeout=timeout, env={**os.environ, **ROOT_OK})
    assert proc.returncode == 0 and "run completed" in proc.stderr, proc.stderr[-3000:]
    (path,) = runs_dir.iterdir()
    return path


@pytest.fixture(scope="session")
def colocate_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_smoke(tmp_path_factory.mktemp("colocate"), COLOCATE)


@pytest.fixture(scope="session")
def elastic_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_smoke(tmp_path_factory.mktemp("elastic"), ELASTIC)
