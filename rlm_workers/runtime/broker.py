"""The workers' broker transport: kombu's Redis transport with one fix, chosen through Celery's ``broker_transport``
when a worker starts (``celery_app``).

On connection loss a consumer closes its channel, and closing puts unacked messages back, which needs a fresh
client whose parameters come from a connection already torn down (``conninfo`` is None): an AttributeError that
kombu 5.x reports as "Unrecoverable error", and the worker exits (the family of kombu#582, celery#8030).  Raising
the transport's own ConnectionError instead lets kombu's ``ignore_errors()`` swallow it; Redis redelivers those
messages after the visibility timeout, as for any lost connection.  A subclass declared in the configuration, not
a patch of kombu's class: every other user of kombu in the process keeps kombu as it ships.
"""

from __future__ import annotations

from urllib.parse import urlparse

import redis
from kombu.transport import redis as kombu_redis

#: the broker URL schemes this transport serves (any other broker keeps the transport its scheme names)
REDIS_SCHEMES = frozenset({"redis", "rediss"})


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> dict:
        if self.connection is None or self.connection.client is None:
            raise redis.exceptions.ConnectionError("connection already closed")
        return super()._connparams(asynchronous=asynchronous)


class Transport(kombu_redis.Transport):
    Channel = Channel


def transport_for(broker_url: str) -> str | None:
    """The ``broker_transport`` setting for this broker: ours for Redis (and Valkey), None for any other."""
    return f"{__name__}:Transport" if urlparse(broker_url).scheme in REDIS_SCHEMES else None
