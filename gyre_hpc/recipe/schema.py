"""The recipe schema: one small, frozen config dataclass per component.

A recipe is a TOML file with one table per component. Each component is handed only its own
dataclass (the controller passes ``recipe.engine`` to the engine, never the whole recipe), so a
component's knobs are documented and validated in one place: here.

Field metadata carries the documentation (``doc``) and numeric bounds (``min``/``max``); allowed
string values are ``Literal`` types. ``recipe.load`` enforces both and names the TOML path of any
violation. Cross-section rules live in ``Recipe.__post_init__``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from gyre_hpc.errors import RecipeError
from gyre_hpc.recipe.entry import POLICY_LOSSES, custom_policy_loss
from gyre_hpc.trajectory.records import ROLE_PRIORITY

Mode = Literal["elastic", "async", "colocate"]
COMMAND_FIELDS = ("workspace", "instruction", "task_id", "run_id", "timeout_s")
"""What ``agent.command`` may name (``agents.external.fields`` fills them per execution)."""


def knob(default: Any, doc: str, *, min: float | None = None, max: float | None = None) -> Any:
    """A documented recipe field; lists get a fresh copy per instance. A number has a range: both
    bounds are required (``recipe.load`` refuses what lies outside, and any infinity or NaN)."""
    if isinstance(default, int | float) and not isinstance(default, bool) and (min is None or max is None):
        raise TypeError(f"knob {doc[:40]!r}…: a number needs min and max")
    meta = {"doc": doc, "min": min, "max": max}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """What the run is called, where it writes and how long it lasts."""

    name: str = knob("run", "Run name; the run directory is <runs_dir>/<name>-<time>.")
    runs_dir: str = knob("runs", "Where run directories are created (shared storage on a cluster).")
    model: str = knob("tiny", "Hugging Face model directory, or 'tiny' for the offline tiny Qwen3.")
    seed: int = knob(0, "Seed for prompts, sampling and initialisation.", min=0, max=(1 << 32) - 1)
    steps: int = knob(2, "Optimizer steps to run.", min=1, max=10_000_000)
    max_restarts: int = knob(
        0,
        "Restarts of the world from the newest checkpoint when a rank dies (node loss, OOM).",
        min=0,
        max=1000,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class CellsConfig:
    """How the GPUs are grouped into cells, each holding one complete model replica."""

    count: int = knob(2, "Number of cells; cell 0 is the core (weights and optimizer).", min=1, max=4096)
    ranks_per_cell: int = knob(1, "MPI ranks per cell (one per GPU on a cluster).", min=1, max=4096)
    capacity: int = knob(8, "Concurrent executions one sampling cell serves.", min=1, max=100_000)
    rollout_pool: int = knob(
        0, "Standalone rollout engines that never switch role (one rank each).", min=0, max=4096
    )
    heartbeat_s: float = knob(
        0.5, "Seconds between a cell's status reports to the controller.", min=0.01, max=60
    )
    heartbeat_timeout_s: float = knob(60.0, "A cell silent this long is declared dead.", min=1, max=86400)
    hello_timeout_s: float = knob(
        120.0,
        "Seconds the controller waits for every cell to say hello, beyond engine.start_timeout_s.",
        min=1,
        max=86400,
    )
    gpu_memory_gib: float = knob(
        0.0,
        "Memory of one GPU of a cell in GiB (an H200: 140): the memory plan checks the recipe "
        "against it (`gyre-hpc recipe check` prints the plan); 0: not planned (CPU runs).",
        min=0.0,
        max=65536.0,
    )
    host_memory_gib: float = knob(
        0.0,
        "Host memory of one node of a cell in GiB (an 8 × H200 node: 2048): the memory plan checks "
        "a node's ranks (cells.ranks_per_cell / slurm.nodes_per_cell) against it; 0: not planned.",
        min=0.0,
        max=16_777_216.0,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Which policy decides the cells' roles."""

    mode: Mode = knob("elastic", "elastic (water level), async (fixed split) or colocate (all, in turn).")
    async_train_cells: int = knob(
        1,
        "async: number of cells, first in switch order, that always train.",
        min=1,
        max=4096,
    )
    min_queued_microsteps: int = knob(
        1,
        "elastic: micro-steps that must be queued before the next cell may switch to training.",
        min=1,
        max=1_000_000,
    )
    carry_tail: bool = knob(
        False,
        "elastic: apply each step when its burst ends and train the untrained rest in the next step "
        "(one version stale) instead of making the next burst wait for it; steps that write a "
        "checkpoint still train everything (so set trainer.checkpoint_every > 1).",
    )
    max_staleness: int = knob(
        0,
        "elastic: 0 keeps the step barrier (a step waits for its last execution); k > 0 closes a "
        "step once prompts_per_step complete groups are in, executions still running continue under "
        "the new weights and land in a later step, and one that would be trained more than k "
        "versions after its first call is stopped and partially scored (replaces carry_tail); steps "
        "that write a checkpoint still wait for every execution (so set trainer.checkpoint_every > 1).",
        min=0,
        max=1000,
    )
    lookahead: float = knob(
        0.25,
        "max_staleness > 0: the share of the next step's prompts dispatched with each step, so their "
        "executions fill the slots the current step's tail leaves free (0: none).",
        min=0.0,
        max=1.0,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """The sampling engine each cell (and the rollout pool) runs."""

    backend: Literal["embedded", "sglang", "emulated"] = knob(
        "embedded",
        "embedded (torch, CPU or one GPU), sglang (a real SGLang server per cell) or emulated "
        "(decoding is a clock; benchmarks).",
    )
    device: Literal["auto", "cpu", "cuda"] = knob(
        "auto", "Where engines compute; auto: the GPU the cell's rank owns, else the CPU."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto",
        "Served weights' dtype; auto: float32 for the embedded engine, SGLang's own choice for sglang "
        "(it serves a float32 checkpoint as float16).",
    )
    tp_size: int = knob(
        1,
        "Tensor-parallel size of one engine replica: a cell serves with ranks_per_cell / tp_size "
        "replicas, each on its own GPUs (a replica larger than a node spans whole nodes).",
        min=1,
        max=1024,
    )
    ep_size: int = knob(
        1,
        "sglang, routed-expert models: expert-parallel size inside a replica (--ep-size): each "
        "expert lives on one of ep_size of the replica's tp_size GPUs, tokens travel to it; must "
        "divide tp_size.",
        min=1,
        max=1024,
    )
    attn_dp_size: int = knob(
        1,
        "sglang: attention data-parallel groups inside a replica (--attn-dp-size): each group of "
        "tp_size / attn_dp_size GPUs attends for its own requests while the MLP (the experts) spans "
        "the replica, for models with fewer key/value heads than the replica has GPUs; must divide "
        "tp_size.",
        min=1,
        max=1024,
    )
    moe_a2a_backend: Literal["none", "deepep"] = knob(
        "none",
        "sglang, expert parallelism: how tokens reach their experts' GPUs (--moe-a2a-backend): none "
        "(SGLang's gather and reduce), deepep (DeepEP's all-to-all kernels, installed beside SGLang).",
    )
    allow_idle_gpus: bool = knob(
        False,
        "Allow a layout that leaves GPUs of a sampling cell without an engine (a node's ranks not a "
        "multiple of tp_size); refused otherwise.",
    )
    mem_fraction_static: float = knob(0.8, "GPU memory fraction for weights and KV cache.", min=0.05, max=1.0)
    enable_memory_saver: bool = knob(
        True, "sglang on a GPU: release and resume GPU memory on role switches (it needs CUDA)."
    )
    max_total_tokens: int = knob(
        0,
        "KV cache size in tokens; 0 lets the engine decide (sglang on the CPU: 16384).",
        min=0,
        max=1 << 40,
    )
    weight_sync: Literal["tensor", "delta", "broadcast", "disk"] = knob(
        "tensor",
        "sglang: how a new version reaches the server: tensor (each bucket staged once on the "
        "cell leader's GPU and read by every server rank by CUDA IPC; a shared-memory file on "
        "the CPU), delta (the same path, carrying only the elements whose bits changed since the "
        "version the server holds, checksummed, whole when it holds another; both sides keep a "
        "host copy in the served dtype), broadcast (over a process group the leader forms with "
        "the server, gloo: CPU only, since on GPUs the group would hold the leader's GPU twice), "
        "or a checkpoint on disk. A replica across nodes takes tensor (each node's part stages "
        "every bucket on its own GPU), broadcast (CPU) or disk, not delta.",
    )
    weight_bucket_mb: int = knob(
        512,
        "sglang broadcast: a version goes to the server in buckets of this many MiB, in the served "
        "dtype; one bucket is staged at a time on each side.",
        min=1,
        max=1 << 20,
    )
    start_timeout_s: float = knob(
        900.0, "sglang: seconds a server may take to become healthy.", min=1, max=86400
    )
    restart_attempts: int = knob(
        3, "sglang: starts a server that died (or died while it started) gets before the cell fails.",
        min=1, max=100,
    )  # fmt: skip
    restart_backoff_s: float = knob(
        1.0, "sglang: seconds before a failed start is tried again, doubling each time.", min=0, max=600
    )
    max_new_tokens: int = knob(1024, "Tokens one model call may generate.", min=1, max=1 << 24)
    prefix_cache: bool = knob(
        True, "Reuse the KV of earlier turns; off with cells.capacity = 1, every call is bit-reproducible."
    )
    temperature: float = knob(1.0, "Sampling temperature.", min=0.0, max=100.0)
    top_p: float = knob(1.0, "Nucleus sampling mass.", min=0.0, max=1.0)
    emulated_decode_s: float = knob(
        0.02,
        "emulated: seconds per decode step; every running call gains one token.",
        min=0.001,
        max=60,
    )
    emulated_tokens_median: float = knob(100.0, "emulated: median reply length in tokens.", min=1, max=1e7)
    emulated_tokens_sigma: float = knob(
        0.6,
        "emulated: log-normal spread of reply lengths (the long tail).",
        min=0.0,
        max=10.0,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """The training replica each cell runs while in the TRAINING role."""

    backend: Literal["torch", "megatron", "emulated"] = knob(
        "torch", "torch (plain PyTorch), megatron (megatron-core) or emulated (compute is a delay)."
    )
    dtype: Literal["float32", "bfloat16"] = knob("float32", "Parameter and compute dtype.")
    device: Literal["auto", "cpu", "cuda"] = knob(
        "auto",
        "torch: where it computes; auto: the GPU of the cell's rank where there is one, else the "
        "CPU (megatron always computes on the rank's GPU where there is one).",
    )
    lr: float = knob(1e-6, "Adam learning rate.", min=0.0, max=1.0)
    weight_decay: float = knob(0.0, "AdamW weight decay.", min=0.0, max=10.0)
    grad_clip: float = knob(1.0, "Global gradient-norm clip; 0 disables.", min=0.0, max=1e6)
    clip_low: float = knob(0.2, "PPO ratio clip below 1.", min=0.0, max=1.0)
    clip_high: float = knob(0.28, "PPO ratio clip above 1.", min=0.0, max=100.0)
    dual_clip: float = knob(
        3.0,
        "Dual clip: a token of negative advantage loses at most dual_clip × |advantage| however far "
        "its ratio to the behaviour policy runs (PPO's clip leaves r·A unbounded there); 0 off, "
        "else above 1.",
        min=0.0,
        max=100.0,
    )
    policy_loss: str = knob(
        "ppo",
        "The objective: ppo (clipped ratio per token, dual clip), gspo (one clipped ratio per path: "
        "exp of the mean log-ratio; use a narrow clip_low/clip_high, e.g. 3e-4/4e-4), cispo (the "
        "clipped ratio weights log π, every token keeps its gradient), or module:function "
        "(path/file.py:function) taking (logprobs, anchor, advantages, segments, rule) and "
        "returning the per-token loss (see loss.policy_loss).",
    )
    mismatch_correction: Literal["none", "tis", "mis", "sequence-tis", "sequence-mis", "geometric-mask"] = (
        knob(
            "none",
            "Tokens sampled at the version being trained (their gap to the behaviour log-prob is the "
            "engine's numerics, not staleness): none treats them as any other (the objective against "
            "the behaviour log-prob); the others train them against the weights being trained (ratio 1) "
            "times an importance weight: tis min(π/μ, mismatch_cap); mis π/μ, the token rejected "
            "outside [mismatch_low, mismatch_cap] (icepop); sequence-tis the path's min(Π π/μ, "
            "mismatch_cap); sequence-mis the path's Π π/μ, the path rejected outside the same bounds; "
            "geometric-mask 1, the path rejected when (Π π/μ)^(1/n) lies outside [mismatch_low, "
            "mismatch_cap] (use a narrow band, e.g. 0.99–1.01). Stale tokens keep the objective "
            "against μ either way; a rejected token leaves its path's denominator.",
        )
    )
    mismatch_cap: float = knob(
        2.0,
        "The largest importance weight (tis, sequence-tis) or ratio kept (mis, geometric-mask).",
        min=1.0,
        max=100.0,
    )
    mismatch_low: float = knob(
        0.5, "mis, geometric-mask: the smallest ratio kept (below it the token or path is rejected).",
        min=0.0, max=1.0,
    )  # fmt: skip
    micro_step_tokens: int = knob(8192, "Tokens packed into one micro-step.", min=16, max=1 << 26)
    logprob_chunk: int = knob(
        1024,
        "Loss tokens whose logits exist at once: the output layer and softmax run over this many "
        "rows at a time, forward and again in the backward, never over a whole micro-step "
        "(memory: chunk × vocabulary / tp × 4 bytes, a few times).",
        min=1,
        max=1 << 20,
    )
    tp_size: int = knob(
        1,
        "Tensor-parallel size inside a cell (megatron; ranks beyond tp × pp are data-parallel).",
        min=1,
        max=1024,
    )
    pp_size: int = knob(
        1, "Pipeline-parallel size inside a cell (megatron; GPipe over sequences).", min=1, max=1024
    )
    ep_size: int = knob(
        1,
        "Expert-parallel size inside a cell (megatron, routed-expert models): each stage's experts "
        "are split over this many of its ranks (tp × data-parallel ranks of the stage; it must divide "
        "both them and the experts), tokens travel to their experts and back.",
        min=1,
        max=1024,
    )
    cp_size: int = knob(
        1,
        "Context-parallel size (megatron): each rank would hold 1/cp of a micro-step's positions. "
        "Only 1 runs: megatron-core's context parallelism lives in Transformer Engine's attention "
        "(CUDA only), not in the attention this trainer builds (tree masks); the memory plan "
        "counts a larger value.",
        min=1,
        max=1024,
    )
    moe_aux_loss_coeff: float = knob(
        0.0,
        "megatron, routed-expert models: weight of the router's load-balancing loss (megatron's "
        "aux_loss: experts' token shares times their mean routing probability, per micro-batch); 0 "
        "leaves the router to the policy loss alone.",
        min=0.0,
        max=1.0,
    )
    moe_z_loss_coeff: float = knob(
        0.0,
        "megatron, routed-expert models: weight of the router's z-loss (the squared log-sum-exp of "
        "its logits, which keeps them small); 0 off.",
        min=0.0,
        max=1.0,
    )
    routing_replay: bool = knob(
        True,
        "Routed-expert models: the proxy records the experts the engines routed every token to, and "
        "training sends each token through them (rollout routing replay), so sampling and training "
        "route alike; false lets the trainer's router choose. No effect on a dense model.",
    )
    recompute: Literal["none", "full"] = knob(
        "none",
        "megatron: activation recomputation; full keeps only each layer's input for backward and "
        "recomputes the layer there (about a third more compute, a fraction of the memory).",
    )
    checkpoint_every: int = knob(1, "Write a checkpoint every N steps; 0 never.", min=0, max=10_000_000)
    export_every: int = knob(
        0,
        "Also write a checkpoint's weights as a Hugging Face model every N steps (at the checkpoints "
        "of steps that N divides) when a replica over several ranks keeps them as shards; 0 never "
        "(`gyre-hpc model export` writes one from any checkpoint). A replica of one rank's checkpoints "
        "are Hugging Face models already.",
        min=0,
        max=10_000_000,
    )
    emulated_s_per_token: float = knob(
        0.001,
        "emulated: seconds one cell spends per trained token (forward and backward).",
        min=0.0,
        max=60.0,
    )
    emulated_apply_s: float = knob(
        0.0,
        "emulated: seconds the core's apply takes on top of the real one (summing a large "
        "model's gradients and stepping its optimizer).",
        min=0.0,
        max=86400.0,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportConfig:
    """How snapshots, gradients and KV move between cells."""

    backend: Literal["auto", "verbs", "mpi"] = knob(
        "auto", "auto picks verbs when an RDMA device exists, else mpi."
    )
    verbs_device: str = knob("", "RDMA device name (e.g. mlx5_0); empty: the first one found.")
    verbs_port: int = knob(1, "RDMA device port.", min=1, max=255)
    gid_index: int = knob(0, "GID index (RoCE needs the right one).", min=0, max=255)
    mpi_chunk_mb: int = knob(
        1024,
        "The largest part of one MPI call on a model-sized buffer (a read of the core's snapshot or "
        "of a contributor's gradient), MiB: Open MPI 4.1 counts in 32-bit ints.",
        min=1,
        max=1024,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ProxyConfig:
    """The OpenAI-compatible proxy that records TITO traces."""

    host: str = knob("127.0.0.1", "Address the proxy listens on.")
    port: int = knob(0, "Port; 0 picks a free one (written to the run directory).", min=0, max=65535)
    max_body_mb: int = knob(64, "Largest request body accepted (MiB); larger gets HTTP 413.", min=1, max=4096)
    request_timeout_s: float = knob(
        900.0,
        "A model call that cannot be served in this time fails (503).",
        min=1,
        max=7 * 86400,
    )
    drain_mode: Literal["continue", "restart"] = knob(
        "continue", "On drain: continue in-flight requests elsewhere (KV migration) or restart them."
    )
    admission_limit: int = knob(
        0, "Requests in flight per engine; 0 uses cells.capacity.", min=0, max=100_000
    )
    workers: int = knob(
        1,
        "Proxy processes on the controller's node, each serving a shard of the runs (by run id) into "
        "its own TITO segment, read as one log; an engine's admission limit is split among them.",
        min=1,
        max=64,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    """The agent harness each execution runs: the built-in one, a program, or a Python function."""

    kind: Literal["builtin", "command", "python"] = knob(
        "builtin", "builtin: gyre_hpc's harness; command: run agent.command; python: await agent.entry."
    )
    command: list[str] = knob(
        [], "kind=command: argv template ({workspace}, {instruction}, {task_id}, {run_id}, {timeout_s})."
    )
    entry: str = knob("", "kind=python: module:function, an async function of an AgentContext.")

    max_calls: int = knob(
        64, "Built-in: model calls one execution may make (sub-agents included).", min=1, max=1_000_000
    )
    context_limit_tokens: int = knob(
        8192, "Compact the main context past this many tokens.", min=64, max=1 << 24
    )
    timeout_s: float = knob(
        1800.0, "Wall-clock limit of one execution; then it is partially scored.", min=1, max=7 * 86400
    )
    max_subagents: int = knob(4, "Sub-agents one execution may delegate to.", min=0, max=10_000)
    unreachable_s: float = knob(
        120.0,
        "Built-in: how long a model call keeps trying a proxy it cannot reach (a proxy worker died: "
        "the world restarts meanwhile, and the execution continues from its journal) before the "
        "execution crashes.",
        min=0,
        max=86400,
    )
    command_timeout_s: float = knob(60.0, "Limit of one shell command run by the agent.", min=1, max=86400)
    journal: bool = knob(True, "Journal each execution after every call, so a restarted run continues it.")
    sandbox: Literal["auto", "bwrap", "apptainer", "none"] = knob(
        "auto",
        "Where an execution's commands (and a command harness) run: bwrap or apptainer confine each to "
        "its workspace; none runs them as the runtime's user; auto: bwrap where it works, else none "
        "with a warning.",
    )
    sandbox_image: str = knob("", "sandbox=apptainer: the image (a .sif path or docker://…).")
    sandbox_uid: int = knob(
        65534,
        "Uid and gid sandboxed processes run as when the runtime is root (default: nobody).",
        min=1,
        max=(1 << 31) - 1,
    )
    sandbox_binds: list[str] = knob(
        [], "More read-only paths a sandbox shows (a command harness's program, a toolchain)."
    )
    limits: Literal["auto", "cgroup", "uid", "none"] = knob(
        "auto",
        "How an execution's processes are limited together (max_processes, memory_mb, cpus): cgroup "
        "(v1 or v2, one per execution), uid (root without cgroups: a uid of its own per execution, "
        "RLIMIT_NPROC; memory and CPU per process only), none (per process only); auto: cgroup where "
        "writable, else uid as root, else none with a warning.",
    )
    max_processes: int = knob(
        512, "Processes (and threads) one execution may run at once.", min=8, max=1 << 22
    )
    memory_mb: int = knob(
        4096, "Memory one execution's processes may use together (MiB; also each one's address space).",
        min=64, max=1 << 24,
    )  # fmt: skip
    cpus: float = knob(2.0, "CPUs one execution's processes may use together.", min=0.01, max=4096.0)
    workspace_mb: int = knob(
        2048, "Size of one workspace (MiB); a command that grows it past this is killed.", min=1, max=1 << 24
    )
    workspace_files: int = knob(
        200_000, "Files and directories one workspace may hold; likewise.", min=16, max=1 << 30
    )
    command_output_mb: int = knob(
        256, "A command printing more than this (MiB) is killed; the model is shown far less.",
        min=1, max=1 << 20,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class TasksConfig:
    """Which tasks are run and how many per step."""

    suite: str = knob("smoke", "Built-in suite name or path to a JSONL suite.")
    group_size: int = knob(4, "Executions per prompt (group-relative advantages).", min=1, max=4096)
    prompts_per_step: int = knob(4, "Prompts per optimizer step.", min=1, max=1_000_000)
    eval_every: int = knob(0, "Held-out evaluation every N steps; 0 never.", min=0, max=10_000_000)
    eval_n: int = knob(32, "Held-out tasks per evaluation.", min=1, max=1_000_000)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrajectoryConfig:
    """How TITO records become training sequences."""

    jmax: int = knob(8, "Paths selected per run at most.", min=1, max=100_000)
    priority: list[str] = knob(list(ROLE_PRIORITY), "Role classes in selection priority order.")
    baseline: Literal["mean", "rloo"] = knob(
        "mean",
        "A run's advantage: its reward less its group's mean (mean), or less the mean of the "
        "group's other runs (rloo: leave-one-out, unbiased; n/(n−1) times the mean's).",
    )
    std_normalize: bool = knob(False, "Divide group-relative advantages by the group's std.")
    loss_mean: Literal["run", "token", "sequence"] = knob(
        "run",
        "How token losses are averaged: run (the paper's: mean over a run's selected tokens, then "
        "over runs), token (over every loss token of the update), sequence (over a path's tokens, "
        "then over paths).",
    )
    placeholders: Literal["zero", "exclude"] = knob(
        "zero",
        "A run that left nothing to score (it never reached the model, its workspace vanished: the "
        "infrastructure failed, not the policy): zero counts it in its group's advantages with "
        "reward 0, as the paper does; exclude leaves it out of the group's statistics.",
    )
    packing: Literal["tree", "paths"] = knob(
        "tree",
        "tree: a micro-step's paths forwarded as one packed tree, each shared prefix once; "
        "paths: each path forwarded on its own.",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoringConfig:
    """How finished and timed-out executions are scored."""

    scorer: str = knob("hidden-tests", "Built-in scorer name or dotted path module:Class.")
    max_retries: int = knob(2, "Retries of an evaluation error before the run is dropped.", min=0, max=100)
    timeout_s: float = knob(
        300.0, "Limit of one evaluation: every run of the scorer on one workspace's copies together; past "
        "it, the policy's code scores 0.", min=1, max=86400,
    )  # fmt: skip
    copy_allowance_s: float = knob(
        120.0, "Time one evaluation may spend copying the workspace, all its copies together, on top of "
        "timeout_s (a copy at the default quota of 200,000 files takes 10-30 s); past it, the policy's "
        "workspace scores 0.", min=1, max=86400,
    )  # fmt: skip
    test_timeout_s: float = knob(
        60.0, "Limit of one hidden test or check; past it, that test fails.", min=0.1, max=86400
    )
    sandbox_binds: list[str] = knob(
        [],
        "Read-only paths a scorer's sandbox shows besides what an execution's shows (a verifier's "
        "own scripts and data); never shown to an execution.",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorsConfig:
    """CPU nodes that run executions (harness, tool commands, scorers) instead of the controller's
    node: a het component of their own under ``gyre-hpc submit``, local processes under
    ``gyre-hpc run``. Each pulls work from the controller and reaches the proxy over the network."""

    nodes: int = knob(0, "Executor nodes; 0 runs every execution on the controller's node.", min=0, max=4096)
    slots_per_node: int = knob(
        64, "Executions one executor node runs at once; more wait for a free slot.", min=1, max=100_000
    )
    lease_s: float = knob(
        10.0,
        "An executor silent this long is dead: its executions are placed again (the built-in "
        "harness's continue from their journal, black-box ones start again).",
        min=1,
        max=3600,
    )
    partition: str = knob("", "Partition of the executor nodes; empty: slurm.controller_partition's.")
    cpus_per_node: int = knob(16, "CPUs per executor node (its one task's --cpus-per-task).", min=1, max=4096)
    mem: str = knob("", "Memory per executor node (e.g. 64G); empty: the partition default.")
    constraint: str = knob("", "Node feature constraint for executor nodes; empty: none.")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmConfig:
    """The heterogeneous sbatch job `gyre-hpc submit` renders."""

    partition: str = knob("", "Partition for the cells; empty: the cluster default.")
    controller_partition: str = knob("", "Partition for the controller; empty: same as partition.")
    account: str = knob("", "Account to charge; empty: your default.")
    qos: str = knob("", "Quality of service; empty: default.")
    time: str = knob("04:00:00", "Wall-clock limit (Slurm time format).")
    nodes_per_cell: int = knob(
        1,
        "Nodes one cell spans; cells.ranks_per_cell is split evenly over them.",
        min=1,
        max=4096,
    )
    gpus_per_node: int = knob(
        0,
        "GPUs per cell node (--gpus-per-node): every rank of a node sees them all and takes the "
        "one of its local rank; 0 asks for none.",
        min=0,
        max=64,
    )
    gpu_per_task: bool = knob(
        False,
        "Bind one GPU to each cell rank (--gpus-per-task=1, for sites that bind GPUs to tasks) "
        "instead of asking per node; each rank then sees only its own, so an SGLang engine must "
        "have engine.tp_size = 1 (a server cannot span GPUs bound to other tasks).",
    )
    cpus_per_task: int = knob(4, "CPUs per cell rank.", min=1, max=1024)
    controller_cpus: int = knob(4, "CPUs for the controller (proxy, harness, trajectories).", min=1, max=1024)
    mem: str = knob("", "Memory per node (e.g. 200G); empty: the partition default.")
    constraint: str = knob("", "Node feature constraint; empty: none.")
    exclusive: bool = knob(False, "Ask for cell nodes exclusively.")
    mpi: str = knob("pmix", "srun --mpi plugin; pmix is what Open MPI needs.")
    python: str = knob("", "Python on the compute nodes; empty: the one running gyre-hpc submit.")
    setup: list[str] = knob([], "Shell lines run before srun (module load, activate an environment).")
    signal_grace_s: int = knob(
        120,
        "Seconds before the time limit at which the job is told to checkpoint.",
        min=0,
        max=86400,
    )
    requeue: bool = knob(True, "Requeue the job on preemption or node failure.")


@dataclass(frozen=True, kw_only=True, slots=True)
class ObservabilityConfig:
    """Experiment trackers fed from the step and evaluation records (``observability.tracking``),
    beside events.jsonl, metrics.png and cells.png, which every run writes."""

    tensorboard: bool = knob(True, "TensorBoard event files under <run_dir>/tensorboard/.")
    wandb_project: str = knob(
        "", "Weights & Biases project to log to; empty: none (needs pip install 'gyre-hpc[wandb]')."
    )
    wandb_mode: Literal["offline", "online"] = knob(
        "offline",
        "offline: the W&B run is written under <run_dir>/wandb/ (wandb sync uploads it); online: "
        "streamed to the W&B server (compute nodes need its address).",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """Side-by-side comparisons of scheduling modes."""

    modes: list[Mode] = knob(
        ["elastic", "async", "colocate"], "Modes `gyre-hpc bench modes` runs, on the same workload and seed."
    )
    async_splits: list[int] = knob(
        [], "async: the splits (cells that train) `bench modes` runs; empty: every split, the best compared."
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """A whole run: one section per component."""

    run: RunConfig = field(default_factory=RunConfig)
    cells: CellsConfig = field(default_factory=CellsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    trajectory: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    executors: ExecutorsConfig = field(default_factory=ExecutorsConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)

    def __post_init__(self) -> None:
        cells, sched, trainer = self.cells, self.scheduler, self.trainer
        if self.agent.kind == "command" and not self.agent.command:
            example = '["my-agent", "{instruction}"]'
            raise RecipeError(f'agent.kind = "command" needs agent.command, an argv list (e.g. {example})')
        for arg in self.agent.command:
            try:
                arg.format(**dict.fromkeys(COMMAND_FIELDS, ""))
            except (KeyError, IndexError, ValueError) as err:
                raise RecipeError(
                    f"agent.command: {arg!r} names {err}; valid fields: {', '.join(COMMAND_FIELDS)}"
                    " (double a brace to mean it: {{ }})"
                ) from None
        if self.agent.sandbox == "apptainer" and not self.agent.sandbox_image:
            raise RecipeError(
                'agent.sandbox = "apptainer" needs agent.sandbox_image (a .sif path or docker://…)'
            )
        if self.agent.kind == "python" and not self.agent.entry:
            raise RecipeError('agent.kind = "python" needs agent.entry = "module:function"')
        if cells.ranks_per_cell % self.slurm.nodes_per_cell:
            raise RecipeError(
                f"cells.ranks_per_cell = {cells.ranks_per_cell} must be a multiple of "
                f"slurm.nodes_per_cell = {self.slurm.nodes_per_cell}"
            )
        if cells.ranks_per_cell % (trainer.tp_size * trainer.pp_size):
            raise RecipeError(
                f"cells.ranks_per_cell = {cells.ranks_per_cell} must be a multiple of "
                f"trainer.tp_size * trainer.pp_size = {trainer.tp_size * trainer.pp_size}"
            )
        if trainer.cp_size > 1:
            raise RecipeError(
                f"trainer.cp_size = {trainer.cp_size}: megatron-core's context parallelism runs only in "
                "Transformer Engine's attention (megatron/core/transformer/dot_product_attention.py:58, "
                '"Context parallelism is only supported by TEDotProductAttention!"), which needs CUDA '
                'and takes no tree mask; valid: 1 (long paths: trainer.recompute = "full", more tp/pp)'
            )
        if 0 < trainer.dual_clip <= 1:
            raise RecipeError(f"trainer.dual_clip = {trainer.dual_clip} must be 0 (off) or above 1")
        if trainer.policy_loss not in POLICY_LOSSES:
            custom_policy_loss(
                trainer.policy_loss
            )  # one line if it does not import or has the wrong signature
        stage_ranks = cells.ranks_per_cell // (trainer.tp_size * trainer.pp_size) * trainer.tp_size
        if stage_ranks % trainer.ep_size:
            raise RecipeError(
                f"trainer.ep_size = {trainer.ep_size} must divide the {stage_ranks} ranks of a pipeline "
                f"stage (cells.ranks_per_cell / trainer.pp_size)"
            )
        slurm = self.slurm
        if slurm.gpu_per_task and slurm.gpus_per_node:
            raise RecipeError(
                f"slurm.gpu_per_task = true and slurm.gpus_per_node = {slurm.gpus_per_node}: ask for "
                "GPUs one way; set slurm.gpus_per_node = 0"
            )
        engine = self.engine
        for key in ("ep_size", "attn_dp_size"):
            if engine.tp_size % getattr(engine, key):
                raise RecipeError(
                    f"engine.{key} = {getattr(engine, key)} must divide engine.tp_size = {engine.tp_size} "
                    "(a replica's GPUs)"
                )
        if engine.backend != "sglang" and (engine.ep_size, engine.attn_dp_size, engine.moe_a2a_backend) != (
            1, 1, "none"):  # fmt: skip
            raise RecipeError(
                f"engine.ep_size, attn_dp_size and moe_a2a_backend are SGLang's; valid with "
                f"engine.backend = {engine.backend!r}: 1, 1 and 'none'"
            )
        if slurm.gpu_per_task and self.engine.backend == "sglang" and self.engine.tp_size > 1:
            raise RecipeError(
                f"engine.tp_size = {self.engine.tp_size} with slurm.gpu_per_task = true: a cell leader's "
                "SGLang server would span GPUs bound to other tasks, which it cannot see; set "
                "engine.tp_size = 1, or ask per node (slurm.gpus_per_node)"
            )
        splits = range(1, cells.count + (cells.rollout_pool > 0))
        if bad := [k for k in self.bench.async_splits if k not in splits]:
            raise RecipeError(
                f"bench.async_splits = {bad}: with cells.count = {cells.count} valid splits are "
                f"{splits.start} … {splits.stop - 1} (async needs a cell or a rollout pool sampling)"
            )
        if sched.max_staleness and sched.mode != "elastic":
            raise RecipeError(
                f'scheduler.max_staleness = {sched.max_staleness} needs scheduler.mode = "elastic" '
                f"(got {sched.mode!r}); set it to 0 for {sched.mode}"
            )
        if sched.max_staleness and trainer.checkpoint_every == 1:
            raise RecipeError(
                f"scheduler.max_staleness = {sched.max_staleness} with trainer.checkpoint_every = 1: every "
                "step writes a checkpoint, so every step waits for all its executions; set "
                "trainer.checkpoint_every to 0 or more than 1"
            )
        if sched.mode == "async" and sched.async_train_cells >= cells.count + (cells.rollout_pool > 0):
            raise RecipeError(
                f"scheduler.async_train_cells = {sched.async_train_cells} leaves no cell sampling "
                f"(cells.count = {cells.count}); async needs at least one sampling cell or a rollout pool"
            )


# Section name -> its config dataclass, in recipe order.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Recipe)}  # type: ignore[misc]
