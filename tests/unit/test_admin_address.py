"""The admin endpoint listens on one address, the one ``admin_listening`` names.

An outside test found ``--admin localhost:0`` on a host whose ``localhost`` is both
127.0.0.1 and ::1 listening on two ports, one of them named nowhere (asyncio listens on
every address a name has, each on a free port of its own), and a taken port on the other
address caught only after the group had started."""

from __future__ import annotations

import asyncio
import socket

import pytest

from mmsched import admin
from mmsched.errors import ConfigError


def _dual_stack(monkeypatch):
    """``localhost`` as Debian's and Docker's hosts files give it: ::1 first, then 127.0.0.1."""
    real = socket.getaddrinfo

    def both(host, port, *args, **kwargs):
        if host == "localhost":
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(admin.socket, "getaddrinfo", both)


def test_a_name_with_two_addresses_listens_on_its_ipv4_one_alone(monkeypatch):
    _dual_stack(monkeypatch)
    assert admin.listen_address("localhost:0") == (socket.AF_INET, "127.0.0.1", 0)

    class View:
        def health(self):
            return True, "serving"

    async def start_and_look():
        server = admin.AdminServer(View(), "localhost:0")
        await server.start()
        try:
            return [s.getsockname()[:2] for s in server._site.sockets]
        finally:
            await server.close()

    listening = asyncio.run(start_and_look())
    assert len(listening) == 1 and listening[0][0] == "127.0.0.1" and listening[0][1] > 0, listening


def test_the_start_up_check_tries_the_address_the_endpoint_will_use(monkeypatch):
    _dual_stack(monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"admin: cannot listen on http://127.0.0.1:{port}"):
            admin.check_admin(f"localhost:{port}")


def test_addresses_in_each_form():
    assert admin.parse_address("9400") == ("127.0.0.1", 9400)
    assert admin.parse_address(":0") == ("127.0.0.1", 0)
    assert admin.parse_address("[::1]:0") == ("::1", 0)
    assert admin.listen_address("0:0")[1] == "0.0.0.0"  # the log names what "0" means: every interface
    family, ip, port = admin.listen_address("[::1]:7")
    assert admin.url(family, ip, port) == "http://[::1]:7"
    assert admin.listen_address("[fe80::1%lo]:7")[1] == "fe80::1%lo"  # a link-local address keeps its zone


def test_a_name_that_does_not_resolve_is_a_config_error():
    with pytest.raises(ConfigError, match="admin: cannot listen on"):
        admin.listen_address("no-such-host.invalid:0")
