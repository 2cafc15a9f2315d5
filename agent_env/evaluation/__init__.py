"""Evaluation: a task's prompts through the agent loop against any engine, into one resumable JSONL file
(`evaluate`); the avg@k, pass@k and maj@k summary (`metrics`); the held-out set a training run scores
its policy versions on, with paired intervals (`heldout`).

May import: `agent_env` (its top modules: the loop, prompts, samples), `rollout`, `tools`.
"""
