"""fxtron.runtime.pp"""
