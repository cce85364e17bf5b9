"""What a bulk transfer does to a small message crossing the same shaped link: the round trip of an
8-byte ping-pong (TCP, no Nagle) with the link idle, and while one bulk TCP stream crosses it.

    sudo .venv/bin/python scripts/link_queue_probe.py --rate 10mbit --queues 400ms 20ms --bulk-bytes 2300000

The link is ``scripts/bench_netns.py``'s (two network namespaces, a veth pair, tbf on both ends at
``--rate`` with ``--queue`` as tbf's latency: the longest a packet may wait in the FIFO queue). The
bulk stream stands for a streamed sync's fragment in flight (2.3 MB: half of DiLoCo's period on
cpu_small), the ping-pong for the small collectives every training step sends across R meanwhile
(torchtitan's token count, the clip's norm): in one FIFO queue they wait behind the bulk bytes queued
ahead of them. Prints, per queue depth, the idle round trip and the median and largest during the
transfer. Exits 0 with "SKIP: ..." where it cannot run (not root, no ``ip``/``tc``).
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench_netns  # noqa: E402
from scripts._bench_common import table  # noqa: E402

SINK_PORT, ECHO_PORT = 5901, 5902

# Run inside node B's namespace: a sink for the bulk stream and an 8-byte echo.
SERVER = f"""
import socket, sys, threading
addr = sys.argv[1]
def listen(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen(4)
    return s
sink, echo = listen({SINK_PORT}), listen({ECHO_PORT})
print("ready", flush=True)
def drain():
    while True:
        c, _ = sink.accept()
        while c.recv(1 << 16):
            pass
        c.close()  # all received: the sender's recv sees the end
threading.Thread(target=drain, daemon=True).start()
c, _ = echo.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    d = c.recv(8)
    if not d:
        break
    c.sendall(d)
"""

# Run inside node A's namespace: idle round trips, then round trips while the bulk bytes cross.
CLIENT = f"""
import json, socket, sys, threading, time
addr, bulk = sys.argv[1], int(sys.argv[2])
e = socket.create_connection((addr, {ECHO_PORT})); e.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
def rtt():
    t = time.perf_counter(); e.sendall(b"x" * 8); got = 0
    while got < 8:
        got += len(e.recv(8 - got))
    return time.perf_counter() - t
idle = [rtt() for _ in range(5)]
b = socket.create_connection((addr, {SINK_PORT}))
def send():  # until B has every byte (sendall returns once the kernel holds them)
    b.sendall(bytes(bulk)); b.shutdown(socket.SHUT_WR); b.recv(1)
sender = threading.Thread(target=send); sender.start()
busy = []
while sender.is_alive():
    busy.append(rtt()); time.sleep(0.02)
print(json.dumps({{"idle": idle, "busy": busy}}))
"""


def probe(addrs, rate: str, queue: str, bulk: int) -> dict:
    bench_netns.shape(rate, "", queue)
    server = subprocess.Popen(["ip", "netns", "exec", bench_netns.NS[1], sys.executable, "-c", SERVER, addrs[1]],
                              stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # "ready"
        out = bench_netns.sh(sys.executable, "-c", CLIENT, addrs[1], str(bulk), ns=bench_netns.NS[0]).stdout
    finally:
        server.kill()
        server.wait()
    return json.loads(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="10mbit")
    p.add_argument("--queues", nargs="+", default=["400ms", "20ms"], help="tbf latency values to compare")
    p.add_argument("--bulk-bytes", type=int, default=2_300_000)
    p.add_argument("--subnet", default="10.213.78.0/24")
    a = p.parse_args(argv)
    why = bench_netns.cannot_run()
    if why:
        print(f"SKIP: link_queue_probe cannot run here: {why}")
        return 0
    addrs = bench_netns.setup(a.subnet)
    rows = []
    try:
        for queue in a.queues:
            r = probe(addrs, a.rate, queue, a.bulk_bytes)
            ms = [x * 1e3 for x in r["busy"]] or [float("nan")]
            rows.append([queue, f"{statistics.median(r['idle']) * 1e3:.2f}", f"{statistics.median(ms):.1f}",
                         f"{max(ms):.1f}", str(len(r["busy"]))])
    finally:
        bench_netns.teardown()
    print(f"tbf rate {a.rate}, one bulk TCP stream of {a.bulk_bytes} bytes A→B, 8-byte ping-pong A→B→A")
    print(table(["queue (tbf latency)", "round trip idle, ms (median)", "during the bulk: median ms", "largest ms",
                 "round trips"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
