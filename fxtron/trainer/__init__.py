"""`fxtron train`: the trainer (loop.py) on the typed configuration's trainer sections -- models
(models.py), data (data.py over fxtron.data), Megatron's learning-rate schedule (schedule.py),
checkpoints in Megatron's layout (checkpoints.py) and metrics (metrics.py)."""
