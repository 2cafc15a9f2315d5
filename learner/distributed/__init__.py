"""Moving tensors between processes: the torch learner's data parallelism (`data_parallel`: whole groups
per rank, summed gradients, norms and proximal log-probs) and weight transport to rollout workers
(`weight_transport`: the object store or a bucketed broadcast).

May import: nothing of the learner layer.
"""
