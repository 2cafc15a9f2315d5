"""The megatron-core backend (`learner.backend: megatron`): the learner (`learner`), the GPT model built
from an HF checkpoint with tensor/pipeline parallel layouts (`model`), and context parallelism for long
packed rows (`context_parallel`).

May import: `learner.backends` (the torch learner it extends), `learner.forward`, `learner.traj_grads`,
`learner.distributed`.
"""
