"""The whole suite runs with the verifier on: every pass's output graph is checked (placements
on every axis, a redistribution at every mismatch; fxtron/passes/verify.py). Set here, before
fxtron is imported, so the ranks the tests start inherit it."""
import os

os.environ.setdefault("FXTRON_VERIFY", "1")
