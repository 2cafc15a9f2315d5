"""Per-trajectory gradients: the exact ‖∇ℓ_i‖² of every trajectory from one backward per packed
micro-batch (`hooks`, `handlers`), the per-group two-buffer accumulation (`buffers`), VCPO/OPOB's
gradient on top of them (`opob_grad`), and the brute-force oracle the tests compare against
(`reference`).

May import: `learner.forward`.
"""
