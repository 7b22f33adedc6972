"""splitinfer.cloud: the cloud service (model repository, batcher, runtimes).

Not built yet: see the open issues. Nothing here is registered as a script.
"""
