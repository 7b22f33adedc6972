"""What the two daemons (edge agent, cloud service) do with their sockets, beside HTTP.

``sockets``: the connection cap and header timeout on a listening socket;
``body``: reading a request body bounded in bytes, time and bytes in flight.
Both daemons use it, so it is a room of its own: it imports only ``shared``,
and ``edge`` and ``cloud`` import it (docs/architecture.md).
"""
