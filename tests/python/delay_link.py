"""Holds every packet a host sends for a fixed time, as `tc netem delay` would on
its interface (this machine's kernel has no netem): run in the host's network
namespace, it makes a TUN device, the host routes what it sends to its subnet
through it, and each packet read from it is written back DELAY ms later, in
order; the kernel then forwards it out of the host's real interface.

    python3 delay_link.py DEVICE DELAY_MS

Prints "ready" once the device exists; stops on SIGTERM. Hosts.delay (launchers.py)
sets up the routes around it."""
import collections
import fcntl
import os
import signal
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def main():
    name, delay = sys.argv[1], float(sys.argv[2]) / 1000.0
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    held = collections.deque()  # (when to send, packet), in the order read: one delay keeps it sorted
    ready = threading.Condition()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    def release():
        while True:
            with ready:
                while not held:
                    ready.wait()
                due, packet = held[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with ready:
                held.popleft()
            try:
                os.write(fd, packet)
            except OSError:
                pass  # a packet the kernel refuses is lost, as on a wire

    threading.Thread(target=release, daemon=True).start()
    print("ready", flush=True)
    while True:
        packet = os.read(fd, 65536)
        with ready:
            held.append((time.monotonic() + delay, packet))
            ready.notify()


if __name__ == "__main__":
    main()
