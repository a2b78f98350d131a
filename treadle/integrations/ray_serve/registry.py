"""Where a treadle front end finds the request router Ray Serve made in its process.

Ray Serve makes a deployment handle's request router from its class, pickled by value
with its whole module (request_router.py): a map kept there would be a copy per router.
This module is imported by reference, so its map is the process's one: the router
registers itself here, the front end (client.py) looks it up. It owns nothing else.
"""

from __future__ import annotations

import weakref

_ROUTERS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def register(app_name: str, deployment_name: str, router) -> None:
    _ROUTERS[(app_name, deployment_name)] = router


def router_for(app_name: str, deployment_name: str):
    """The router Ray Serve made in this process for that deployment's handles, or None."""
    return _ROUTERS.get((app_name, deployment_name))
