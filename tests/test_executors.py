"""Executor nodes: the placement rule, and the hub over real HTTP on loopback (a node that is lost
has its executions placed again, a late word from it counts for nothing, and nothing else than
the runtime can talk to the hub)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gyre_hpc.execution.outcome import Execution, Outcome, ScoreResult
from gyre_hpc.executors.hub import Hub
from gyre_hpc.executors.job import HubAddress, Job
from gyre_hpc.executors.slots import place
from gyre_hpc.observability import events as ev
from gyre_hpc.proxy.keys import KeyRing
from gyre_hpc.recipe.schema import ExecutorsConfig
from gyre_hpc.tasks.task import Task


def test_a_burst_spreads_over_equal_nodes_and_stops_at_the_free_slots() -> None:
    assert place({"b": 2, "a": 2}, 3) == ["a", "b", "a"]
    assert place({"a": 1, "b": 3}, 3) == ["b", "b", "a"]  # the most free slots first
    assert place({"a": 1, "b": 0}, 5) == ["a"]  # what does not fit waits
    assert place({}, 2) == [] and place({"a": 4}, 0) == []


def test_a_job_carries_every_field_of_its_task(tmp_path: Path) -> None:
    task = Task(
        "t", "do it", image="/img", workdir="/app", harbor={"reward": "x"}, swe={"repo": "r"}, timeout_s=5.0
    )
    job = Job("run-1", task, tmp_path / "ws", None, stopped=True, attempt=2)
    assert Job.from_json(job.to_json()) == job


def outcome_json(run_id: str, reward: float = 1.0) -> dict[str, Any]:
    ex = Execution(run_id=run_id, task_id="t", workspace=Path("/w") / run_id, status="finished", calls=3)
    score = ScoreResult(run_id=run_id, kind="scored", reward=reward, attempts=1)
    return Outcome(execution=ex, score=score).to_json()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Served:
    """A hub on loopback, and a client that speaks for executor nodes."""

    def __init__(self, hub: Hub, url: str, http: aiohttp.ClientSession) -> None:
        self.hub, self.url, self.http = hub, url, http

    async def post(self, verb: str, body: Any, token: str | None = "tok") -> tuple[int, Any]:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        async with self.http.post(f"{self.url}/executors/{verb}", json=body, headers=headers) as r:
            text = await r.text()
            try:
                return r.status, await r.json(content_type=None)
            except ValueError:
                return r.status, text

    async def claim(self, node: str, running: list[str] | None = None) -> dict[str, Any]:
        status, body = await self.post("claim", {"node": node, "running": running or []})
        assert status == 200, body
        return body


async def torn_post(s: Served, verb: str, body: Any) -> None:
    """A node killed while it sends ``body``: the headers and half the body, then the connection reset."""
    data = json.dumps(body).encode()
    host, port = s.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /executors/{verb} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer tok\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data[: len(data) // 2]
    )
    await writer.drain()
    writer.transport.abort()


async def serve(clock: Clock, counters: Counter[str], events: list[ev.Event]) -> tuple[Served, web.AppRunner]:
    hub = Hub(
        ExecutorsConfig(lease_s=5.0),
        "tok",
        lambda kind, run: counters.update([kind]),
        events.append,
        clock=clock,
        reap_every_s=3600,  # the test reaps when its clock says
    )
    runner = web.AppRunner(hub.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    return Served(hub, url, aiohttp.ClientSession()), runner


def test_a_lost_node_s_executions_go_elsewhere_and_its_late_or_torn_word_counts_for_nothing(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        clock, counters, events = Clock(), Counter[str](), []
        s, runner = await serve(clock, counters, events)
        try:
            for node in ("n1", "n2"):
                assert (await s.post("register", {"node": node, "slots": 2}))[0] == 200
            jobs = [(f"r{i}", Task(f"t{i}", "x")) for i in range(3)]
            burst = asyncio.create_task(s.hub.run_all(jobs, tmp_path, None, lambda o: None))
            while counters["dispatched"] < 3:
                await asyncio.sleep(0.01)
            got1, got2 = await s.claim("n1"), await s.claim("n2")
            assert [j["run"] for j in got1["jobs"]] == ["r0", "r2"] and [j["run"] for j in got2["jobs"]] == [
                "r1"
            ]
            await s.post("report", {"node": "n1", "started": ["r0", "r2"], "outcomes": []})
            # n1 is killed while it reports r0's outcome: half the request reaches the hub.
            await torn_post(
                s, "report", {"node": "n1", "outcomes": [{"run": "r0", "outcome": outcome_json("r0", 0.0)}]}
            )
            r1 = {"node": "n2", "started": ["r1"], "outcomes": [{"run": "r1", "outcome": outcome_json("r1")}]}
            await s.post("report", r1)
            await s.post("report", r1)  # delivered twice (a retry whose reply was lost): counted once
            # n1 goes silent past its lease; n2 keeps claiming (its heartbeat).
            clock.now += 6
            await s.claim("n2")
            s.hub.reap()
            lost = [e for e in events if isinstance(e, ev.ExecutorLost)]
            assert [(e.node, e.runs) for e in lost] == [("n1", ["r0", "r2"])]
            again = await s.claim("n2")
            assert sorted((j["run"], j["attempt"]) for j in again["jobs"]) == [("r0", 2), ("r2", 2)]
            # The lost node speaks again: unknown, it is told to register; its outcome is not taken.
            status, body = await s.post(
                "report", {"node": "n1", "outcomes": [{"run": "r0", "outcome": outcome_json("r0", 0.0)}]}
            )
            assert status == 409 and body == {"error": "register"}
            # Registered again, it is told to abandon what it still runs.
            await s.post("register", {"node": "n1", "slots": 2})
            assert (await s.claim("n1", running=["r0", "r2"]))["abandon"] == ["r0", "r2"]
            await s.post("report", {"node": "n2", "started": ["r0", "r2"], "outcomes": [
                {"run": r, "outcome": outcome_json(r, 0.5)} for r in ("r0", "r2")]})  # fmt: skip
            outcomes = await asyncio.wait_for(burst, 10)
            assert [(o.execution.run_id, o.score.reward) for o in outcomes] == [
                ("r0", 0.5),
                ("r1", 1.0),
                ("r2", 0.5),
            ]
            assert counters == Counter(dispatched=3, started=3, finished=3)  # each counted once
            placed = [(e.run, e.node, e.attempt) for e in events if isinstance(e, ev.Placed)]
            assert placed == [
                ("r0", "n1", 1),
                ("r1", "n2", 1),
                ("r2", "n1", 1),
                ("r0", "n2", 2),
                ("r2", "n2", 2),
            ]
        finally:
            await s.http.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_stop_reaches_the_node_that_runs_it_and_a_queued_one_starts_stopped(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock, counters, events = Clock(), Counter[str](), []
        s, runner = await serve(clock, counters, events)
        try:
            await s.post("register", {"node": "n1", "slots": 1})
            burst = asyncio.create_task(
                s.hub.run_all([("a", Task("t", "x")), ("b", Task("t", "x"))], tmp_path, None, print)
            )
            while counters["dispatched"] < 2:
                await asyncio.sleep(0.01)
            assert [j["run"] for j in (await s.claim("n1"))["jobs"]] == ["a"]  # one slot
            s.hub.stop(["a", "b"])
            assert (await s.claim("n1", ["a"]))["stop"] == ["a"]
            await s.post("report", {"node": "n1", "outcomes": [{"run": "a", "outcome": outcome_json("a")}]})
            (b,) = (await s.claim("n1"))["jobs"]
            assert (b["run"], b["stopped"]) == ("b", True)
            await s.post("report", {"node": "n1", "outcomes": [{"run": "b", "outcome": outcome_json("b")}]})
            assert len(await asyncio.wait_for(burst, 10)) == 2
        finally:
            await s.http.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_only_the_runtime_can_talk_to_the_hub(tmp_path: Path) -> None:
    """An execution reaches the proxy with its key: that key, or none, or a forged outcome for
    another run, gets it nothing from the hub."""

    async def scenario() -> None:
        clock, counters, events = Clock(), Counter[str](), []
        s, runner = await serve(clock, counters, events)
        try:
            run_key = KeyRing.load(tmp_path / "proxy.secret").mint("r0", "main")
            for token in (None, run_key, "tok2", "tok" + "\u00e9"):
                status, _ = await s.post(
                    "register",
                    {"node": "evil", "slots": 64},
                    token=token if token != "tok\u00e9" else "tok%C3%A9",
                )
                assert status == 401
            assert (await s.post("claim", {"node": "ghost"}))[0] == 409
            assert (await s.post("register", [1, 2]))[0] == 400
            assert (await s.post("register", {"node": "n", "slots": 0}))[0] == 400
            await s.post("register", {"node": "n1", "slots": 4})
            burst = asyncio.create_task(s.hub.run_all([("r0", Task("t", "x"))], tmp_path, None, print))
            await s.claim("n1")
            # An outcome that names another run is not taken: the execution is placed again.
            await s.post("report", {"node": "n1", "outcomes": [{"run": "r0", "outcome": outcome_json("r9")}]})
            assert [(j["run"], j["attempt"]) for j in (await s.claim("n1"))["jobs"]] == [("r0", 2)]
            await s.post("report", {"node": "n1", "outcomes": [{"run": "r0", "outcome": outcome_json("r0")}]})
            assert (await asyncio.wait_for(burst, 10))[0].execution.run_id == "r0"
            assert not [e for e in events if isinstance(e, ev.ExecutorUp) and e.node == "evil"]
        finally:
            await s.http.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_the_hub_address_is_private_and_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "executors" / "hub.json"
    assert HubAddress.read(path) is None
    address = HubAddress("http://h:1", HubAddress.new_token(), "http://h:2", "tiny", "id")
    address.write(path)
    assert HubAddress.read(path) == address and path.stat().st_mode & 0o777 == 0o600
    path.write_text('{"url": ')  # torn: not an address
    assert HubAddress.read(path) is None
    assert asdict(address)["token"] == address.token


def test_an_execution_placed_again_continues_only_if_its_harness_journals(tmp_path: Path) -> None:
    """What a node does with a job the hub placed again: a black-box program starts afresh in a
    fresh workspace (what the lost attempt left is gone); the built-in harness's journalled
    execution keeps its workspace and goes on (``test_faults`` checks its calls continue)."""
    from gyre_hpc.agents.dispatch import Dispatcher, make_harness
    from gyre_hpc.agents.external import Endpoint
    from gyre_hpc.agents.journal import Journal
    from gyre_hpc.recipe.schema import AgentConfig, ScoringConfig
    from gyre_hpc.scoring import ScoringRunners

    program = AgentConfig(
        kind="command", command=["bash", "-c", "ls > seen.txt"], sandbox="none", timeout_s=30
    )
    never_called = Endpoint("http://127.0.0.1:9", lambda r, role: "k", "m")
    harness = make_harness(program, never_called, {}, 0, tmp_path / "logs")
    scoring = ScoringRunners(ScoringConfig(scorer="milestones"))
    journal = Journal(tmp_path / "journal")
    d = Dispatcher(
        harness, lambda t: scoring.get(t.scorer), tmp_path / "ws", tmp_path / "tasks", 4, journal=journal
    )
    left = tmp_path / "ws" / "r1"
    left.mkdir(parents=True)
    (left / "half-done.txt").write_text("the lost node's attempt")
    outcome = asyncio.run(d.run_one("r1", Task("t", "do it", seed={"a.txt": "1"})))
    assert outcome.execution.status == "finished"
    assert (left / "seen.txt").read_text().split() == ["a.txt", "seen.txt"]  # nothing of the first attempt
    # A journalled execution under way (the built-in harness's) is not laid out again.
    journal.call("r2", 0, [{"role": "user", "content": "x"}], 1, {}, 1.0)
    kept = tmp_path / "ws" / "r2"
    kept.mkdir()
    (kept / "progress.txt").write_text("made before the node was lost")
    asyncio.run(d.run_one("r2", Task("t", "do it", seed={"a.txt": "1"})))
    assert (kept / "progress.txt").exists() and not (kept / "a.txt").exists()


def test_a_node_the_hub_lost_registers_again_and_one_whose_hub_moved_follows_it(tmp_path: Path) -> None:
    """A real executor node (``executors.node``) against the hub: lost after a pause, it drops
    what it held and registers with the same hub; a new world's hub (a new hub.json) it finds."""
    from gyre_hpc.executors.node import ExecutorNode
    from gyre_hpc.recipe import Recipe
    from gyre_hpc.recipe.schema import AgentConfig
    from gyre_hpc.rundir import RunDir

    run_dir = RunDir.create(tmp_path, "r")
    recipe = Recipe(agent=AgentConfig(sandbox="none"))
    run_dir.write_recipe(recipe)

    async def scenario() -> None:
        clock, counters, events = Clock(), Counter[str](), []
        s, runner = await serve(clock, counters, events)
        HubAddress(s.url, "tok", "http://127.0.0.1:9", "m", "world-1").write(run_dir.executor_hub)
        node = ExecutorNode(run_dir, recipe, "n1", "h", 4)
        serving = asyncio.create_task(node.serve())

        async def ups(n: int) -> None:
            while sum(isinstance(e, ev.ExecutorUp) for e in events) < n:
                await asyncio.sleep(0.02)

        try:
            await asyncio.wait_for(ups(1), 20)
            clock.now += 60  # a pause longer than the lease
            s.hub.reap()
            await asyncio.wait_for(ups(2), 20)  # back, with the same hub
            assert [e.node for e in events if isinstance(e, ev.ExecutorLost)] == ["n1"]
            # The world restarts: its new hub is written where the node looks.
            clock2, counters2, events2 = Clock(), Counter[str](), []
            s2, runner2 = await serve(clock2, counters2, events2)
            HubAddress(s2.url, "tok", "http://127.0.0.1:9", "m", "world-2").write(run_dir.executor_hub)
            await runner.cleanup()
            while not any(isinstance(e, ev.ExecutorUp) for e in events2):
                await asyncio.sleep(0.02)
            await s2.http.close()
            await runner2.cleanup()
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await s.http.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(scenario(), 60))
