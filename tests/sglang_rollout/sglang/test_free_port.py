"""`free_port` (the ports SGLang's scheduler and the weight group listen on) stays below the
kernel's ephemeral range, which outgoing connections draw from, and a listener can bind it."""

import socket
from pathlib import Path

from sglang_rollout.sglang.weight_group import free_port


def test_free_ports_are_below_the_ephemeral_range_and_bind():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    if low > 21000:
        assert all(20000 <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 1  # drawn at random, not one fixed port
    with socket.socket() as s:
        s.bind(("", ports[0]))
        s.listen()
