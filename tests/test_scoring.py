"""Partial scoring: timed-out runs scored on their artifacts, eval errors retried then dropped,
placeholders for runs that left nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre_hpc.errors import RecipeError
from gyre_hpc.recipe.schema import ScoringConfig
from gyre_hpc.scoring import EvaluationError, RunArtifacts, ScoringRunner, load_scorer

HIDDEN = """
from calc import add, sub, mul, div

def test_add(): assert add(2, 3) == 5
def test_sub(): assert sub(5, 3) == 2
def test_mul(): assert mul(2, 3) == 6
def test_div(): assert div(6, 3) == 2
"""


@pytest.fixture
def task(tmp_path: Path) -> dict:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_calc.py").write_text(HIDDEN)
    return {"hidden_tests": str(hidden)}


def workspace(tmp_path: Path, code: str) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "calc.py").write_text(code)
    return ws


def test_timed_out_run_gets_partial_credit_for_what_it_left(tmp_path: Path, task: dict) -> None:
    ws = workspace(
        tmp_path,
        "def add(a, b): return a + b\ndef sub(a, b): return a - b\n"
        "def mul(a, b): raise NotImplementedError\ndef div(a, b): ...\n",
    )
    runner = ScoringRunner(load_scorer(ScoringConfig(scorer="hidden-tests")), max_retries=1)
    result = runner.score(RunArtifacts("r1", ws, "timed_out", task))
    assert (result.kind, result.reward, result.attempts) == ("partial", 0.5, 1)
    assert result.trainable and result.counts_in_group


def test_broken_code_is_a_legitimate_zero_not_an_evaluation_error(tmp_path: Path, task: dict) -> None:
    ws = workspace(tmp_path, "def add(a, b) return a + b\n")  # a syntax error: the tests cannot import it
    runner = ScoringRunner(load_scorer(ScoringConfig(scorer="hidden-tests")), max_retries=1)
    result = runner.score(RunArtifacts("r", ws, "finished", {**task, "hidden_test_count": 4}))
    assert (result.kind, result.reward) == ("scored", 0.0)


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def score(self, artifacts: RunArtifacts) -> float:
        self.calls += 1
        if self.calls <= self.failures:
            raise EvaluationError("grader container did not start")
        return 1.0


def test_evaluation_error_is_retried_within_budget(tmp_path: Path) -> None:
    result = ScoringRunner(Flaky(2), max_retries=2).score(RunArtifacts("r", tmp_path, "finished"))
    assert (result.kind, result.reward, result.attempts) == ("scored", 1.0, 3)


def test_evaluation_error_past_the_budget_drops_the_run_and_says_why(tmp_path: Path) -> None:
    flaky = Flaky(10)
    result = ScoringRunner(flaky, max_retries=2).score(RunArtifacts("r", tmp_path, "finished"))
    assert (result.kind, result.reward, result.attempts, flaky.calls) == ("dropped", None, 3, 3)
    assert "grader container did not start" in result.reason
    assert not result.trainable and not result.counts_in_group


def test_no_artifact_gets_a_placeholder_that_counts_in_its_group(tmp_path: Path) -> None:
    flaky = Flaky(0)
    result = ScoringRunner(flaky, max_retries=2).score(RunArtifacts("r", tmp_path / "gone", "crashed"))
    assert (result.kind, result.reward, flaky.calls) == ("placeholder", 0.0, 0)
    assert result.counts_in_group and not result.trainable


def test_milestones(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "etc").mkdir(parents=True)
    (ws / "etc" / "app.conf").write_text("port = 8080\n")
    task = {
        "milestones": [
            {"file_exists": "etc/app.conf"},
            {"file_contains": ["etc/app.conf", "port = 8080"]},
            {"command": "test -x run.sh", "weight": 2},
        ]
    }
    scorer = load_scorer(ScoringConfig(scorer="milestones"))
    assert scorer.score(RunArtifacts("r", ws, "finished", task)) == 0.5
    with pytest.raises(EvaluationError, match="leaves the workspace"):
        scorer.score(RunArtifacts("r", ws, "finished", {"milestones": [{"file_exists": "../../etc/passwd"}]}))


def test_scorers_by_name_or_dotted_path() -> None:
    assert type(load_scorer(ScoringConfig(scorer="milestones"))).__name__ == "MilestonesScorer"
    assert type(load_scorer(ScoringConfig(scorer="gyre_hpc.scoring.builtin:HiddenTestsScorer"))).__name__ == (
        "HiddenTestsScorer"
    )
    with pytest.raises(
        RecipeError,
        match="neither a built-in \\(hidden-tests, milestones, verifier, coin, reply, harbor, swe\\)",
    ):
        load_scorer(ScoringConfig(scorer="exact-match"))


def test_a_task_without_hidden_tests_is_an_evaluation_error_not_the_current_directory(tmp_path: Path) -> None:
    scorer = load_scorer(ScoringConfig(scorer="hidden-tests"))
    for task in ({"id": "t"}, {"id": "t", "hidden_tests": ""}):
        with pytest.raises(EvaluationError, match="no hidden tests"):
            scorer.score(RunArtifacts("r", tmp_path, "finished", task))
