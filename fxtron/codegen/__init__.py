"""fxtron.codegen"""
