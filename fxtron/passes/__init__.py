"""fxtron.passes"""
