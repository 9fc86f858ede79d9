"""fxtron.compiler"""
