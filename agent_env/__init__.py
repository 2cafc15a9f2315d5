"""Tasks from YAML, datasets, rewards, the multi-turn SimpleTIR agent loop and evaluation."""
