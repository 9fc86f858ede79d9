"""fxtron.runtime.checkpoint.dcp"""
