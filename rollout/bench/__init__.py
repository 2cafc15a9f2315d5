"""`vcpo bench engine`: tokens/s of every engine backend against HF `generate`, in paired rounds
(`engine`), each backend measured in a worker process of its own (`worker`).

May import: `rollout.engines`, `rollout` (its top modules).
"""
