#!/usr/bin/env python3
"""delay.py — a slow link in user space (this kernel has no netem): forward Ethernet frames
between two interfaces, each one DELAY_MS later than it arrived, dropping LOSS_PCT % of them at
random (both directions). Used by slow.sh; runs until killed.

usage: delay.py IF_A IF_B DELAY_MS [LOSS_PCT]
       delay.py --offload-off IF...   (no TX checksum, TSO or GSO offload on IF: a frame read from
                                       an AF_PACKET socket must be complete and at most one MTU)
"""
import array
import fcntl
import heapq
import random
import select
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SIOCETHTOOL = 0x8946
# ethtool "set" commands (linux/ethtool.h): TX checksum, scatter-gather, TSO, GSO, GRO
ETHTOOL_SETS = (0x17, 0x19, 0x1f, 0x24, 0x2c)


def offload_off(ifname):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for cmd in ETHTOOL_SETS:
        buf = array.array("I", [cmd, 0])
        ifr = struct.pack("16sP", ifname.encode(), buf.buffer_info()[0])
        try:
            fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifr)
        except OSError:
            pass  # a feature the device does not have
    s.close()


def main():
    if sys.argv[1] == "--offload-off":
        for i in sys.argv[2:]:
            offload_off(i)
        return
    a, b, delay_ms = sys.argv[1], sys.argv[2], float(sys.argv[3])
    loss = float(sys.argv[4]) / 100 if len(sys.argv) > 4 else 0.0
    for i in (a, b):
        offload_off(i)
    socks = {}
    for i in (a, b):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((i, 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        socks[i] = s
    other = {socks[a].fileno(): socks[b], socks[b].fileno(): socks[a]}
    by_fd = {s.fileno(): s for s in socks.values()}
    due, seq = [], 0  # (time, seq, socket, frame)
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else None
        ready, _, _ = select.select(list(by_fd), [], [], wait)
        now = time.monotonic()
        for fd in ready:
            while True:
                try:
                    frame, addr = by_fd[fd].recvfrom(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING or (loss and random.random() < loss):
                    continue
                heapq.heappush(due, (now + delay_ms / 1e3, seq, other[fd], frame))
                seq += 1
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, s, frame = heapq.heappop(due)
            try:
                s.send(frame)
            except OSError:
                pass  # a frame the other side refuses is a lost frame


if __name__ == "__main__":
    main()
