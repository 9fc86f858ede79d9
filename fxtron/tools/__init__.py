"""fxtron.tools"""
