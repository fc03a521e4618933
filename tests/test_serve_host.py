"""Where `serve` binds: loopback on a host, every interface inside a container (where 127.0.0.1 is the container's
own loopback, so `docker run -p 8000:8000` could never reach it), and what clients on the machine then dial."""

from __future__ import annotations

import socket

import pytest

from trt_redrafter.serving.launcher import connect_host, default_host, in_container, port_in_use


def test_default_host_is_loopback_outside_a_container(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert not in_container(tmp_path) and default_host(tmp_path) == "127.0.0.1"


@pytest.mark.parametrize("marker", [".dockerenv", "run/.containerenv"])
def test_default_host_is_every_interface_inside_a_container(tmp_path, monkeypatch, marker):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (tmp_path / marker).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / marker).touch()
    assert in_container(tmp_path) and default_host(tmp_path) == "0.0.0.0"


def test_a_kubernetes_pod_is_a_container(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert default_host(tmp_path) == "0.0.0.0"


def test_clients_dial_loopback_for_a_wildcard_bind():
    assert connect_host("0.0.0.0") == "127.0.0.1" and connect_host("::") == "::1"
    assert connect_host("10.1.2.3") == "10.1.2.3" and connect_host("127.0.0.1") == "127.0.0.1"
    # and that address reaches a listener bound to every interface
    with socket.socket() as srv:
        srv.bind(("0.0.0.0", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        assert port_in_use("0.0.0.0", port)
        with socket.create_connection((connect_host("0.0.0.0"), port), timeout=5):
            pass


def test_serve_help_says_what_the_default_is(capsys):
    from trt_redrafter.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "0.0.0.0" in out and "container" in out

