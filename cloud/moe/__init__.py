"""Mixture-of-experts layers in the cloud: executor, expert cache, package export.

See docs/moe.md. torch is only needed by ``export`` (and the CUDA device).
"""
