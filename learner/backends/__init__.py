"""Learner backends: the config → objective/step-size mapping (`algorithm_from_config`), the torch learner
(`torch_learner`), its LoRA adapters (`lora`: peft's layers injected, the merged policy for the engines),
and megatron-core (`megatron/`). A backend takes a minibatch of trajectories and
makes one optimizer step; it knows nothing of engines, the training loop or Ray.

May import: `learner.forward`, `learner.traj_grads`, `learner.distributed`.
"""
