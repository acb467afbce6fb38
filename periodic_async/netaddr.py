"""HOST:PORT addresses (rollout.remote_address, a rendezvous store's address): the one parser,
config-free and torch-free."""
from __future__ import annotations


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port); ValueError unless there is a host and the port is a number.
    The last ':' separates them, so 'fe80::1:29650' is host 'fe80::1', port 29650."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r}: expected HOST:PORT")
    return host, int(port)
