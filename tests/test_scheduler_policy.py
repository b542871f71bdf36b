"""The scheduling policy over random traces: capacity rule, serial in-order switches, service."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_hpc.recipe.schema import SchedulerConfig
from gyre_hpc.scheduler.policy import (
    Role,
    SchedState,
    StepCounters,
    carries_tail,
    decide,
    initial_roles,
    sched_state,
    writes_checkpoint,
)

S, T = Role.SAMPLING, Role.TRAINING


def state(**kw) -> SchedState:
    base = dict(
        mode="elastic",
        roles=(S, S, S),
        capacity=(4, 4, 4),
        pool_capacity=0,
        dispatched=12,
        finished=0,
        queued=0,
        step_open=False,
    )
    return SchedState(**{**base, **kw})


def test_the_core_switches_first_once_the_water_has_fallen() -> None:
    assert decide(state(finished=3, queued=2)) == []  # w = 9 > C_R − C_e = 8
    (sw,) = decide(state(finished=4, queued=2))  # w = 8
    assert (sw.cell, sw.role) == (0, T)
    assert decide(state(finished=4, queued=0)) == []  # nothing to train yet


def test_the_last_trainer_returns_when_executions_would_lack_a_server() -> None:
    (sw,) = decide(state(roles=(T, T, S), finished=7, queued=3, step_open=True))  # w = 5 > 4
    assert (sw.cell, sw.role) == (1, S)


def test_idle_trainers_return_after_the_step_and_one_engine_always_serves() -> None:
    (sw,) = decide(state(roles=(T, T, S), finished=12, step_open=False))
    assert (sw.cell, sw.role) == (1, S)
    (sw,) = decide(state(roles=(T, T, S), dispatched=0, finished=0, queued=9, step_open=True))
    assert (sw.cell, sw.role) == (2, T)  # after the burst every cell may train
    assert decide(state(roles=(T, T, S), finished=11, queued=9, step_open=True)) == []


def test_async_and_colocate() -> None:
    assert [(s.cell, s.role) for s in decide(state(mode="async"))] == [(0, T)]
    assert initial_roles("async", 3, 2) == [T, T, S]
    colocate = dict(mode="colocate", step_open=True)
    assert decide(state(**colocate, finished=11, queued=5)) == []  # one execution still runs
    assert {s.role for s in decide(state(**colocate, finished=12, queued=5))} == {T}
    assert decide(state(**colocate, finished=12, roles=(T, T, T), queued=0)) == []  # training it out
    closed = state(mode="colocate", roles=(T, T, T), finished=12, step_open=False)
    assert [(s.cell, s.role) for s in decide(closed)] == [(0, S), (1, S), (2, S)]  # all back at once
    assert {s.role for s in decide(state(mode="colocate", roles=(T, T, T), finished=0))} == {S}


def test_the_counters_become_the_policy_s_view_by_the_boundary_rules() -> None:
    sched = SchedulerConfig(mode="elastic", min_queued_microsteps=2)
    roles, caps = (T, S, S), (4, 4, 4)
    open_ = StepCounters(dispatched=12, finished=10, packed=7, claimed=3, open=True)
    s = sched_state(sched, roles, caps, 0, open_)
    assert (s.water, s.queued, s.step_open, s.min_queued) == (2, 4, True, 2)
    claimed_ahead = StepCounters(12, 10, packed=3, claimed=4, open=True)  # a waiting trainer's claim
    assert sched_state(sched, roles, caps, 0, claimed_ahead).queued == 0
    stopped = StepCounters(12, 12, packed=7, claimed=3, open=True, stopped=True)  # carry_tail
    assert sched_state(sched, roles, caps, 0, stopped).queued == 0
    closed = sched_state(sched, roles, caps, 0, open_.closed())
    assert (closed.queued, closed.step_open) == (0, False)
    assert [(x.cell, x.role) for x in decide(closed)] == [(0, S)]  # a closed step sends trainers back


def test_after_the_burst_any_queued_work_is_trained_whatever_min_queued() -> None:
    # Fewer micro-steps than min_queued once every execution has ended: waiting would never end.
    (sw,) = decide(state(finished=12, queued=1, step_open=True, min_queued=4))
    assert (sw.cell, sw.role) == (0, T)
    assert decide(state(finished=8, queued=1, step_open=True, min_queued=4)) == []  # the burst runs


def test_checkpoint_steps() -> None:
    assert [s for s in range(1, 8) if writes_checkpoint(s, 3, last_step=7)] == [3, 6, 7]
    assert not any(writes_checkpoint(s, 0, last_step=7) for s in range(1, 8))


events = st.lists(
    st.sampled_from(["finish", "finish", "finish", "queue", "claim", "close", "burst"]), max_size=200
)


@settings(max_examples=300, deadline=None)
@given(
    trace=events,
    caps=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    pool=st.integers(0, 4),
    burst=st.integers(1, 30),
)
def test_random_traces_keep_the_rules(trace: list[str], caps: list[int], pool: int, burst: int) -> None:
    s = SchedState(
        mode="elastic",
        roles=tuple([S] * len(caps)),
        capacity=tuple(caps),
        pool_capacity=pool,
        dispatched=burst,
        finished=0,
        queued=0,
        step_open=False,
    )
    for event in trace:
        if event == "finish" and s.water > 0:
            s = replace(s, finished=s.finished + 1)
        elif event == "queue" and s.finished > 0:
            s = replace(s, queued=s.queued + 1, step_open=True)
        elif event == "claim" and s.queued and s.training_prefix:
            s = replace(s, queued=s.queued - 1)
        elif event == "close" and s.queued == 0 and s.water == 0:
            s = replace(s, step_open=False)
        elif event == "burst" and s.water == 0 and not s.step_open:
            s = replace(s, dispatched=s.dispatched + burst)
        switches = decide(s)
        assert len(switches) <= 1, "switches are serial"
        for sw in switches:
            k = s.training_prefix
            if sw.role == T:
                assert sw.cell == k, "the next cell in switch order goes to training"
                assert s.water <= s.rollout_capacity - s.capacity[k], "capacity rule"
            else:
                assert sw.cell == k - 1, "the last trainer returns first"
            roles = list(s.roles)
            roles[sw.cell] = sw.role
            s = replace(s, roles=tuple(roles))
            assert s.roles[: s.training_prefix] == (T,) * s.training_prefix
            assert all(r == S for r in s.roles[s.training_prefix :]), "trainers form a prefix"
        assert s.rollout_capacity > 0 or s.water == 0, "running executions always have an engine"


def test_carry_tail_only_where_it_keeps_staleness_at_one_and_leaves_no_work_behind() -> None:
    ok = dict(mode="elastic", carry_tail=True, trainers=3, ends_run=False, checkpoint=False, stale_left=0)
    assert carries_tail(**ok)
    assert not carries_tail(**{**ok, "carry_tail": False})  # the paper's rule
    assert not carries_tail(**{**ok, "mode": "colocate"})
    assert not carries_tail(**{**ok, "trainers": 0})  # nothing would be applied
    assert not carries_tail(**{**ok, "ends_run": True})  # the last step trains everything
    assert not carries_tail(**{**ok, "checkpoint": True})  # a checkpoint leaves no work in flight
    assert not carries_tail(**{**ok, "stale_left": 2})  # nothing is carried twice


def test_in_flight_stops_what_would_be_trained_more_than_k_behind_and_closes_at_the_quota() -> None:
    from gyre_hpc.scheduler.inflight import closes, in_flight, lookahead, to_stop

    assert in_flight(SchedulerConfig(mode="elastic", max_staleness=1))
    assert not in_flight(SchedulerConfig(mode="elastic")) and not in_flight(SchedulerConfig(mode="colocate"))
    # A step trained from version 5 with k = 2: first versions 3 (2 behind now, 3 in any later
    # step) are stopped; 4 and 5 may wait for a later step.
    assert to_stop({"a": 3, "b": 4, "c": 5, "d": 2}, 5, 2) == ["a", "d"]
    assert to_stop({"a": 4}, 5, 1) == ["a"] and to_stop({"a": 5}, 5, 1) == []
    # The quota closes a step once no stopped execution is still on its way ...
    assert closes(complete=8, quota=8, running=5, stale_running=0, barrier=False)
    assert not closes(complete=8, quota=8, running=5, stale_running=1, barrier=False)
    assert not closes(complete=7, quota=8, running=5, stale_running=0, barrier=False)
    # ... a barrier waits for every execution, and a step that can get no more groups closes.
    assert not closes(complete=9, quota=8, running=1, stale_running=0, barrier=True)
    assert closes(complete=3, quota=8, running=0, stale_running=0, barrier=False)
    # The look-ahead: a share of the next step's prompts, never on a barrier or the last step.
    assert lookahead(1, 10, False, 8, 0.25) == 2 and lookahead(1, 10, False, 3, 0.34) == 2
    assert lookahead(1, 10, True, 8, 0.25) == 0 and lookahead(10, 10, False, 8, 0.25) == 0
    assert lookahead(1, 10, False, 8, 0.0) == 0 and lookahead(1, 10, False, 8, 1.0) == 8
