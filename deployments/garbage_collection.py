"""How often a replica's process looks for garbage cycles.

Python's collector walks its youngest generation after every 700 net allocations of container objects. A request
through a replica allocates hundreds (Serve's ASGI scope and messages, headers, the handle call's metadata, our
request and its futures), so at the default a collection ran every request or two, each walking the objects of the
requests still in flight and promoting them to the older generations, walked again later. After 20,000 most of a
finished request's objects were already freed by their reference counts, so a collection walks only what is live,
a few dozen times less often. Memory held by unreachable cycles waits a little longer to be freed; the older
generations keep Python's ratios to the youngest.
"""

from __future__ import annotations

import gc

YOUNGEST_THRESHOLD = 20_000  # net allocations between collections of the youngest generation (Python's: 700)


def collect_less_often() -> None:
    """In a replica's constructor: its process collects at ``YOUNGEST_THRESHOLD`` from then on."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNGEST_THRESHOLD, middle, oldest)
