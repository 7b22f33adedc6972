"""splitinfer.edge: the edge agent daemon (runtimes, pipeline, uplink client).

Not built yet: see the open issues. Nothing here is registered as a script.
"""
