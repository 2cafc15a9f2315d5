"""The shared forward pass: trajectories packed into rows (`packing`), attention that stays inside each
packed trajectory (`varlen_attention`), and target log-probs of packed rows (`logprobs`). Every
backend, gradient path and benchmark builds on these.

May import: nothing of the learner layer.
"""
