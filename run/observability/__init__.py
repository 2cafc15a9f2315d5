"""Observability: what a run records and shows — metric names (`metric_names`), the JSONL/TensorBoard/W&B
writer and reader (`metrics_log`), the trained trajectories as text (`trajectory_log`), the live progress
line (`progress`) and what it shows between steps (`live_activity`), `vcpo plot` (`plot`) and
`vcpo trend` (`trend`).

May import: `vcpo` (for metric keys), `rollout` (the trajectories it logs), `agent_env` (the rollout
side's live counts); nothing else of this layer (it is its bottom).
"""
