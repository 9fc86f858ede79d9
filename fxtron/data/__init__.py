"""The trainer's data: Megatron's indexed token datasets (indexed.py), its GPT datasets, splits
and blends (gpt.py), and `python -m fxtron preprocess` (preprocess.py)."""
