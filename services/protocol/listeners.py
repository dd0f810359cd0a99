"""The TCP sockets a process listens on, read from Linux /proc: a process learns listeners that a
library opened for it (UCX's, under NIXL), and tests check that nothing listens off loopback."""
from __future__ import annotations

import ipaddress
import os


def listening_sockets(pids: list[int]) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN that one of `pids` holds (Linux /proc)."""
    inodes = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue                    # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:     # 0A: LISTEN
                    continue
                hex_ip, hex_port = local.split(":")
                raw = bytes.fromhex(hex_ip)
                # /proc prints the address as 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(raw[:width])
                ip = getattr(ip, "ipv4_mapped", None) or ip       # ::ffff:127.0.0.1 is 127.0.0.1
                found.add((str(ip), int(hex_port, 16)))
    return found
