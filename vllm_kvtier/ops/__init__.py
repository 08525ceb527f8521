"""Operator tools behind the ``kvtier`` command (capacity planning, ...): pure functions
and start-up checks, never imported by the serving path (the connector)."""
