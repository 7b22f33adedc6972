"""splitinfer.sim: trace-driven network emulation and scenario runs.

Not built yet: see the open issues. Nothing here is registered as a script.
"""
