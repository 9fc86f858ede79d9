"""fxtron.runtime"""
