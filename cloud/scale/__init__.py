"""Scale the cloud service out on Ray Serve (optional: ``pip install 'splitinfer[ray]'``).

``config`` (the deployment options), ``routing`` (which model version a request
goes to, and the replica's per-version engines; no Ray), ``ray_serve`` (the
Serve deployments, the application builder and a local ``deploy``). Nothing
outside this package imports Ray; see docs/scale-out.md.
"""
