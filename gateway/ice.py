"""Which host addresses aioice offers as ICE candidates.

aioice leaves out loopback when it gathers host candidates, and picks every other interface;
a gateway bound to one address (127.0.0.1 for local use and tests, or one public interface)
should offer exactly that. aioice reads the list from one module-level function, so that is
the one thing replaced.
"""

from __future__ import annotations

import aioice.ice

_stock = aioice.ice.get_host_addresses


def restrict_host_addresses(addresses: list[str] | None) -> None:
    """Offer only `addresses` (None restores aioice's own choice)."""
    if not hasattr(aioice.ice, "get_host_addresses"):
        raise RuntimeError("aioice.ice.get_host_addresses is gone: aioice changed under us")
    if addresses is None:
        aioice.ice.get_host_addresses = _stock
        return
    fixed = list(addresses)

    def get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        return [a for a in fixed if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]

    aioice.ice.get_host_addresses = get_host_addresses
