"""One execution cannot take the host down: limits across all its processes, a workspace quota,
output streamed and cut, no user namespaces of its own (real bwrap, real cgroups).

Each attack is a model's ``run_shell`` call in a sandboxed execution with its own limits group,
as the harness runs it; after each, the next execution runs as if nothing had happened.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import assert_golden, missing

from gyre_hpc.agents.tools import MAIN_TOOLS, execute, parse_call
from gyre_hpc.agents.workspace import Workspace
from gyre_hpc.sandbox import seccomp, untrusted
from gyre_hpc.sandbox.confine import Sandbox
from gyre_hpc.sandbox.limits import Group, Groups, Limits, choose, hierarchies

pytestmark = pytest.mark.bwrap
MiB = 1 << 20


def needs_cgroups() -> Groups:
    groups, note = choose("auto", Limits())
    if groups.kind not in ("cgroup-v1", "cgroup-v2"):
        missing("cgroups", f"no writable cgroups here ({note})")
    return groups


def box(limits: Limits, kind: str = "cgroup") -> Sandbox:
    groups, _ = choose(kind, limits)
    return Sandbox("bwrap", groups=groups)


def shell(ws: Workspace, command: str, timeout_s: float = 20) -> str:
    return execute(parse_call("run_shell", json.dumps({"command": command}), MAIN_TOOLS), ws, timeout_s, None)


def fresh(sandbox: Sandbox, root: Path, name: str) -> tuple[Workspace, object]:
    """A new execution: its workspace and its limits group (closed by the caller)."""
    ws_dir = root / name
    ws_dir.mkdir(parents=True)
    root.chmod(0o755)
    group = sandbox.groups.open(name)
    sandbox.prepare(ws_dir, group)
    return Workspace(ws_dir, sandbox, group=group), group


def next_execution_is_unaffected(sandbox: Sandbox, root: Path) -> None:
    ws, group = fresh(sandbox, root, f"next-{time.monotonic_ns()}")
    try:
        started = time.monotonic()
        assert shell(ws, "echo ok; ls") == "exit code 0\nok\n"
        assert time.monotonic() - started < 10
    finally:
        group.close()


def peak_resident_mb() -> float:
    """This process's (the runtime's) peak resident memory since ``reset_peak``."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5\n")  # the high-water mark, down to what is resident now


@pytest.mark.cgroups
def test_a_fork_bomb_is_bounded_by_the_execution_s_process_limit(tmp_path: Path) -> None:
    needs_cgroups()
    sandbox = box(Limits(processes=64))
    ws, group = fresh(sandbox, tmp_path, "bomb")
    try:
        started = time.monotonic()
        out = shell(ws, "bomb() { bomb | bomb & }; bomb; sleep 30", timeout_s=4)
        assert out.startswith("timed out after 4 s (killed)"), out[:300]
        assert time.monotonic() - started < 20
        assert group.events()["processes"] > 0  # forks were refused at the limit
        assert group.pids() == []  # and everything it started is gone
    finally:
        group.close()
    next_execution_is_unaffected(sandbox, tmp_path)


@pytest.mark.cgroups
def test_four_processes_of_one_and_a_half_gib_share_one_memory_limit(tmp_path: Path) -> None:
    needs_cgroups()
    sandbox = box(Limits(memory_bytes=2048 * MiB))
    ws, group = fresh(sandbox, tmp_path, "hog")
    grab = "python3 -c 'import time; b = b\"x\" * (1536 << 20); time.sleep(3)'"
    try:
        out = shell(ws, f"for i in 1 2 3 4; do {grab} & done; wait; echo done", timeout_s=60)
        assert out.startswith("exit code 0") and "done" in out, out[:300]
        assert group.events()["memory"] >= 2  # at most one of the four fits: the others were killed
        assert group.peak_memory() <= 2048 * MiB
    finally:
        group.close()
    next_execution_is_unaffected(sandbox, tmp_path)


def test_a_command_printing_two_gigabytes_leaves_the_runtime_s_memory_flat(tmp_path: Path) -> None:
    sandbox = box(Limits(output_bytes=4096 * MiB), kind="auto")
    ws, group = fresh(sandbox, tmp_path, "print")
    try:
        reset_peak()
        before = peak_resident_mb()
        out = shell(ws, "head -c 2000000000 /dev/zero | tr '\\0' x; echo; echo end", timeout_s=120)
        grew = peak_resident_mb() - before
        assert out.startswith("exit code 0") and out.endswith("end\n")
        assert "bytes of output cut" in out and len(out) < 20_000  # the model sees ~16 kB of it
        assert grew < 64, f"the runtime grew by {grew:.0f} MB while a command printed 2 GB"
    finally:
        group.close()
    # Past agent.command_output_mb the command is stopped, not drained.
    capped, group = fresh(box(Limits(output_bytes=64 * MiB), kind="auto"), tmp_path, "capped")
    try:
        out = shell(capped, "cat /dev/zero", timeout_s=60)
        assert out.startswith("killed: printed more than 64 MiB"), out[:200]
    finally:
        group.close()
    next_execution_is_unaffected(sandbox, tmp_path)


def test_a_disk_flood_is_stopped_at_the_workspace_quota(tmp_path: Path) -> None:
    sandbox = box(Limits(workspace_bytes=128 * MiB, workspace_entries=2000), kind="auto")
    ws, group = fresh(sandbox, tmp_path, "flood")
    try:
        out = shell(ws, "for i in $(seq 12); do head -c 64M /dev/zero > f$i; done; echo done", timeout_s=60)
        held = untrusted.usage(ws.root, 10**9, 10**12)
        assert out.startswith("killed: the workspace went over its quota"), out[:300]
        assert held.bytes < 128 * MiB + 3 * 64 * MiB, held  # at most what one poll interval lets through
        out = shell(ws, "mkdir -p many && cd many && for i in $(seq 20000); do : > $i; done", timeout_s=60)
        assert out.startswith("killed: the workspace went over its quota"), out[:300]
        assert untrusted.usage(ws.root, 10**9, 10**12).entries < 20_000  # stopped before it was done
        # Over its quota, the workspace may shrink but not grow.
        assert shell(ws, "head -c 1M /dev/zero > more; sleep 5").startswith("killed: the workspace went over")
        assert shell(ws, "rm -rf f* many more && echo freed") == "exit code 0\nfreed\n"
        assert shell(ws, "head -c 1M /dev/zero > small && echo ok") == "exit code 0\nok\n"
        # A flood quicker than one poll is caught when the command ends, and said.
        out = shell(ws, "head -c 60M /dev/zero > a; head -c 60M /dev/zero > b; head -c 60M /dev/zero > c")
        assert "over its quota" in out, out[:300]
    finally:
        group.close()
    next_execution_is_unaffected(sandbox, tmp_path)


@pytest.mark.seccomp
def test_no_user_namespace_with_capabilities_inside_the_sandbox(tmp_path: Path) -> None:
    if (why := seccomp.problem()) is not None:
        missing("seccomp", why)
    sandbox = box(Limits(), kind="auto")
    ws, group = fresh(sandbox, tmp_path, "userns")
    try:
        for attempt in (
            "unshare -r id -u",
            "unshare -U -r sh -c 'mount -t tmpfs none /tmp && echo mounted'",
            "python3 -c 'import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); "
            "sys.exit(os.strerror(ctypes.get_errno()) if libc.unshare(0x10000000) else 0)'",
        ):
            out = shell(ws, attempt)
            assert not out.startswith("exit code 0"), (attempt, out)
            assert "Operation not permitted" in out or "PermissionError" in out, (attempt, out)
        assert shell(ws, "python3 -c 'import os; print(os.fork() >= 0)'").startswith("exit code 0\nTrue")
    finally:
        group.close()


RUNNER = "import os\nwhile True:\n    if os.fork():\n        os._exit(0)\n"
"""A process that forks its successor and exits, over and over: its pid is never the same twice."""


@pytest.mark.cgroups
@pytest.mark.parametrize("runners", [1, 8])
def test_a_group_is_frozen_while_it_is_killed_so_no_process_forks_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runners: int
) -> None:
    """Fork runners and a hundred sleepers in one group are all gone after one ``kill``: the group is
    frozen before the first SIGKILL (a list of pids read while they fork is stale before it is used)."""
    from gyre_hpc.sandbox import limits

    groups = needs_cgroups()
    with groups.group("probe") as probe:
        freezer = next((d for d in probe.dirs if (d / "freezer.state").exists()), None)
        if freezer is None and not probe.v2:
            missing("cgroups", "no freezer hierarchy is mounted")
    g = groups.open("runners")
    freezer = next((d for d in g.dirs if (d / "freezer.state").exists()), None)
    states: list[str] = []
    kill = os.kill

    def watched(pid: int, sig: int) -> None:
        states.append(freezer.joinpath("freezer.state").read_text().strip() if freezer else "v2")
        kill(pid, sig)

    procs = [subprocess.Popen([*g.prefix(), "python3", "-c", RUNNER]) for _ in range(runners)]
    procs.append(subprocess.Popen([*g.prefix(), "sh", "-c", "for i in $(seq 100); do sleep 60 & done; wait"]))
    try:
        while len(g.pids()) < 100:  # every sleeper started
            time.sleep(0.01)
        monkeypatch.setattr(limits.os, "kill", watched)
        g.kill()
        monkeypatch.undo()
        assert g.pids() == []
        assert states and states[0] in ("FROZEN", "v2"), states[:5]
    finally:
        g.close()
        for p in procs:
            p.wait()


@pytest.mark.root  # the uid fallback gives each execution a uid of its own: root only
def test_without_cgroups_each_execution_s_processes_are_bounded_under_a_uid_of_its_own(
    tmp_path: Path,
) -> None:
    sandbox = box(Limits(processes=32), kind="uid")
    ws, group = fresh(sandbox, tmp_path, "bomb-uid")
    try:
        assert group.uid is not None and (ws.root.stat().st_uid == group.uid)
        assert shell(ws, "id -u") == f"exit code 0\n{group.uid}\n"
        out = shell(ws, "for i in $(seq 100); do sleep 30 & done; wait", timeout_s=4)
        assert "Resource temporarily unavailable" in out, out[:300]
        left = subprocess.run(["pgrep", "-u", str(group.uid)], capture_output=True, text=True).stdout
        assert left == ""
    finally:
        group.close()
    next_execution_is_unaffected(sandbox, tmp_path)


# -- the pure parts -------------------------------------------------------------------------------

HYBRID_MOUNTS = """\
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
HYBRID_CGROUP = "8:pids:/\n4:memory:/job_42/step_0\n1:cpu:/\n0::/\n"
V2_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
V2_CGROUP = "0::/system.slice/slurmstepd.scope/job_42\n"


def test_the_cgroup_hierarchies_are_read_from_mounts_and_the_process_s_cgroup() -> None:
    h = hierarchies(HYBRID_MOUNTS, HYBRID_CGROUP)
    assert h.v1 == {
        "pids": Path("/sys/fs/cgroup/pids"),
        "memory": Path("/sys/fs/cgroup/memory/job_42/step_0"),
        "cpu": Path("/sys/fs/cgroup/cpu"),
    }
    v2 = hierarchies(V2_MOUNTS, V2_CGROUP)
    assert v2.v1 == {} and v2.v2 == Path("/sys/fs/cgroup/system.slice/slurmstepd.scope/job_42")
    assert v2.v2_mount == Path("/sys/fs/cgroup")


KERNEL_FILES = {
    "cgroup-v1": {"pids": ("pids.max",), "memory": ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
                  "cpu": ("cpu.cfs_period_us", "cpu.cfs_quota_us")},
    "cgroup-v2": {"job": ("pids.max", "memory.max", "memory.swap.max", "cpu.max")},
}  # fmt: skip
WRITTEN = {
    "cgroup-v1": {"pids/pids.max": "100", "memory/memory.limit_in_bytes": str(3 * MiB),
                  "memory/memory.memsw.limit_in_bytes": str(3 * MiB),
                  "cpu/cpu.cfs_period_us": "100000", "cpu/cpu.cfs_quota_us": "150000"},
    "cgroup-v2": {"job/pids.max": "100", "job/memory.max": str(3 * MiB), "job/memory.swap.max": "0",
                  "job/cpu.max": "150000 100000"},
}  # fmt: skip


@pytest.mark.parametrize("kind", ["cgroup-v1", "cgroup-v2"])
def test_a_group_writes_its_limits_as_each_cgroup_version_names_them(tmp_path: Path, kind: str) -> None:
    """The files a group writes, in directories holding the files the kernel makes in a new cgroup
    (v2 is not mounted here with its controllers; v1 is checked on the real kernel above)."""
    dirs = []
    for d, files in KERNEL_FILES[kind].items():
        (tmp_path / d).mkdir()
        for name in files:
            (tmp_path / d / name).write_text("max\n")
        dirs.append(tmp_path / d)
    g = Group(
        "calc-0-g0",
        Limits(processes=100, memory_bytes=3 * MiB, cpus=1.5),
        tuple(dirs),
        v2=kind == "cgroup-v2",
    )
    g.set_limits()
    written = {f"{p.parent.name}/{p.name}": p.read_text().strip() for d in dirs for p in sorted(d.iterdir())}
    assert written == WRITTEN[kind]
    assert g.procs == [str(d / "cgroup.procs") for d in dirs]
    assert g.prefix("/run/f.bpf")[:4] == ["sh", "-c", g.prefix()[2], "gyre-limits"]
    assert g.prefix("/run/f.bpf")[4:] == ["/run/f.bpf", *g.procs, "--"]


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_the_seccomp_filter_is_golden(machine: str) -> None:
    program = seccomp.program(machine)
    lines = [program[i : i + 8].hex(" ") for i in range(0, len(program), 8)]
    text = "\n".join(lines) + "\n"
    assert_golden(f"seccomp-{machine}.txt", text)


@pytest.mark.cgroups
def test_a_harbor_task_s_own_memory_and_storage_bound_its_execution(tmp_path: Path) -> None:
    """``[environment] memory`` and ``storage`` of a Harbor task replace the recipe's limits for
    its execution alone: 768 MiB fits the recipe's 2 GiB, not the task's 512 MiB."""
    from gyre_hpc.sandbox.confine import task_limits
    from gyre_hpc.tasks import harbor

    needs_cgroups()
    root = tmp_path / "tasks" / "small"
    (root / "tests").mkdir(parents=True)
    (root / "instruction.md").write_text("Do it.\n")
    (root / "task.toml").write_text('[environment]\nmemory = "512M"\nstorage_mb = 1\ncpus = 1\n')
    (root / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    task, _ = harbor.read_task(root)
    recipe = Limits(memory_bytes=2048 * MiB)
    assert task_limits(recipe, task) == Limits(memory_bytes=512 * MiB, cpus=1.0, workspace_bytes=1 * MiB)
    sandbox = box(recipe)
    grab = "python3 -c 'b = b\"x\" * (768 << 20); print(len(b) >> 20)'"
    for shown, limits, fits in ((sandbox, 2048 * MiB, True), (sandbox.for_task(task), 512 * MiB, False)):
        ws_dir = tmp_path / f"ws-{limits}"
        ws_dir.mkdir()
        tmp_path.chmod(0o755)
        group = shown.groups.open(ws_dir.name)
        try:
            assert group.limits.memory_bytes == limits
            shown.prepare(ws_dir, group)
            out = shell(Workspace(ws_dir, shown, group=group), grab, timeout_s=60)
            ok = out.startswith("exit code 0\n768")
            assert ok == fits, out[:300]
            if not fits:
                assert "MemoryError" in out or group.events()["memory"] >= 1, out[:300]  # rlimit/cgroup
                # and the workspace holds no more than the task's storage
                over = shell(Workspace(ws_dir, shown, group=group), "head -c 3000000 /dev/zero > big")
                # (the size the watcher saw when it polled, as the write was under way)
                assert re.search(r"over its quota: \d+ MiB \(at most 1 MiB\)", over), over[:300]
        finally:
            group.close()


# ---- what the quota and the copies see, at any path length and for sparse files ---------------------
# The policy's own shell builds these in its workspace; the quota and every scorer's copy read them.

NEST_PAST_PATH_MAX = "d=$(printf 'a%.0s' $(seq 250)); for i in $(seq 20); do mkdir $d && cd $d; done; "


def test_a_file_nested_past_path_max_counts_toward_the_quota_and_is_left_out_of_a_copy(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    made = subprocess.run(["bash", "-c", NEST_PAST_PATH_MAX + "head -c 5M /dev/zero > hidden"], cwd=ws)
    assert made.returncode == 0
    used = untrusted.usage(ws, 10**9, 10**12)
    assert used.bytes == 5 * MiB and used.entries == 21  # 20 directories and the file, 5,020 bytes deep
    assert used.over(200_000, 1 * MiB) == "5 MiB (at most 1 MiB)"
    copied = untrusted.copy_tree(ws, tmp_path / "copy", 10**6, 10**12)
    assert any("longer than 4096 bytes" in why for why in copied.left_out), copied.left_out
    assert untrusted.usage(tmp_path / "copy", 10**9, 10**12).bytes == 0
    untrusted.remove(ws)
    assert not ws.exists()


def test_a_sparse_file_is_counted_at_its_size_and_copied_sparse(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    script = "truncate -s 1G sparse && head -c 64K /dev/urandom | dd of=sparse bs=64K seek=8000 conv=notrunc"
    assert subprocess.run(["bash", "-c", script], cwd=ws).returncode == 0
    assert untrusted.usage(ws, 10**9, 10**12).bytes == 1 << 30  # counted at its size, not its blocks
    copied = untrusted.copy_tree(ws, tmp_path / "copy", 10, 2 << 30)
    assert copied.left_out == [] and copied.bytes == 1 << 30
    src, dst = ws / "sparse", tmp_path / "copy" / "sparse"
    assert dst.stat().st_size == 1 << 30 and dst.stat().st_blocks * 512 <= 1 * MiB  # holes stay holes
    with src.open("rb") as a, dst.open("rb") as b:
        for offset in (0, 8000 * 64 * 1024, (1 << 30) - 4096):
            a.seek(offset), b.seek(offset)
            assert a.read(64 * 1024) == b.read(64 * 1024), offset
