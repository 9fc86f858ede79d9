"""`fxtron train`: the trainer on the typed configuration's trainer sections -- the loop
(loop.py: each iteration a step, an evaluation, a checkpoint, metrics), models (models.py: the
one resolver of a model spec, which `fxtron inspect` reads too), data (data.py over
fxtron.data), AdamW's groups and the learning-rate schedule (optim.py; Megatron's schedule in
schedule.py), the run's saves and resume in Megatron's layout (checkpoint.py), metrics and the
trace (metrics.py), and --compare's one-process run (compare.py, over tools/reference.py)."""
