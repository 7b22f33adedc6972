"""``netsim fleet``: thousands of devices and a cloud of replicas on simulated time.

Each device has its package's cuts (the manifest's predicted costs), a link replayed
from a Mahimahi trace at its own offset, a request process and the real
:class:`~splitinfer.edge.chooser.CutChooser`; each cloud replica runs the real
:class:`~splitinfer.cloud.batcher.Batcher` and overload control. Per-request work
(arrivals, device times, link transfers) is numpy over all devices
(:mod:`.engine`, :mod:`.links`, :mod:`.devices`); the batchers take one Python step per
request and batch (:mod:`.replica`). :mod:`.scenario` reads the TOML format,
:mod:`.report` the figures and pictures, :mod:`.capacity` the replica search.
docs/netsim.md ("Fleet") is the user's guide.
"""
