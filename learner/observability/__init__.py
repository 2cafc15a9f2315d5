"""Observability: what a run records and shows — metric names (`metric_names`), the JSONL/TensorBoard/W&B
writer and reader (`metrics_log`), the live progress line (`progress`), `vcpo plot` (`plot`) and
`vcpo trend` (`trend`).

May import: `vcpo` (for metric keys); nothing of the learner layer (it is its bottom).
"""
