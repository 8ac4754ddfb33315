"""The embedded broker (tansu) is ready only when it serves its own port."""

from __future__ import annotations

import os
import socket

import pytest

from conveyor.brokers import embedded
from conveyor.brokers.embedded import EmbeddedBrokerError, start_embedded_broker
from conveyor.core.host.ports import free_port, listens_on


def test_listens_on_tells_which_process_holds_a_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listens_on(os.getpid(), port) is True
        assert listens_on(1, port) is False  # init does not hold it
    assert listens_on(os.getpid(), port) is False  # closed


def test_a_picked_port_taken_before_tansu_binds_it_is_tried_again_elsewhere(monkeypatch, tmp_path):
    # Another process (here: this one) takes the port picked free before tansu binds it,
    # and accepts connections on it: the start must not take that listener for tansu.
    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    stolen = thief.getsockname()[1]
    picks = iter([stolen])
    monkeypatch.setattr(embedded, "free_port", lambda host: next(picks, None) or free_port(host))
    try:
        with start_embedded_broker(log_path=tmp_path / "tansu.log") as broker:
            assert broker.port != stolen
            assert listens_on(broker.process.pid, broker.port) is True
    finally:
        thief.close()


def test_a_port_chosen_by_the_user_and_in_use_is_an_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(EmbeddedBrokerError, match="already in use"):
            start_embedded_broker(s.getsockname()[1])
