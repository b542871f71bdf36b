"""Scoring finished, timed-out and crashed executions on the artifacts they left."""

from gyre_hpc.scoring.contract import EvaluationError, NoArtifact, RunArtifacts, Scorer, WorkspaceFault
from gyre_hpc.scoring.runner import ScoringRunner, ScoringRunners, load_scorer

__all__ = [
    "EvaluationError",
    "NoArtifact",
    "RunArtifacts",
    "Scorer",
    "ScoringRunner",
    "ScoringRunners",
    "WorkspaceFault",
    "load_scorer",
]
