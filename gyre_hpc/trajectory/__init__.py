"""Trajectory processing: TITO records → trajectory tree → Jmax selection → weighted sequences.

Pure Python and NumPy: no MPI, no HTTP, no torch (the loss lives in ``gyre_hpc.loss``).
"""

from gyre_hpc.trajectory.records import ROLE_PRIORITY, CallMeta, EncodedRecord, TitoRecord
from gyre_hpc.trajectory.select import SelectedPath, select_paths
from gyre_hpc.trajectory.tree import Leaf, TrajectoryTree

__all__ = [
    "ROLE_PRIORITY",
    "CallMeta",
    "EncodedRecord",
    "Leaf",
    "SelectedPath",
    "TitoRecord",
    "TrajectoryTree",
    "select_paths",
]
