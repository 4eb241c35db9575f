"""How long after a SIGKILL a process's sockets close, by how much memory it held.

A killed worker's peers learn of its death when its TCP connections close, and the kernel closes them only
after it has freed the process's memory (``exit_mm`` runs before ``exit_files``), so the larger a killed
worker's state, the later its peers' collectives fail. For each size this starts two processes that import
torch and connect to a listener here: one that then fills a tensor of that many MiB (anonymous memory, every
page touched), one that holds nothing more (a torchrun agent). Both are killed with SIGKILL at once; printed
is the time from the kill to each connection's end of stream, the median of ``--repeats`` kills.

    .venv/bin/python benchmarks/teardown.py --sizes 100,1000
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import time

CHILD = """
import os, socket, sys, time
import torch
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
x = torch.ones(int(sys.argv[2]) * 2**20 // 4)  # every page written
s.sendall(b"%8d" % os.getpid())
time.sleep(600)
"""


def one_kill(mb: int) -> dict[str, float]:
    """Seconds from SIGKILL to the end of stream of a process holding ``mb`` MiB and of one holding none."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(2)
        port = str(srv.getsockname()[1])
        procs = {
            "state": subprocess.Popen([sys.executable, "-c", CHILD, port, str(mb)]),
            "bare": subprocess.Popen([sys.executable, "-c", CHILD, port, "0"]),
        }
        try:
            names = {proc.pid: name for name, proc in procs.items()}
            conns, by_conn = [], {}
            srv.settimeout(120)
            for _ in procs:
                conn, _addr = srv.accept()
                conn.settimeout(120)
                pid = int(conn.recv(8, socket.MSG_WAITALL))  # sent once its memory is touched
                conns.append(conn)
                by_conn[conn] = names[pid]
            time.sleep(0.3)
            started = time.monotonic()
            for proc in procs.values():
                os.kill(proc.pid, signal.SIGKILL)
            ended: dict[str, float] = {}
            open_conns = list(conns)
            while open_conns:
                ready, _, _ = select.select(open_conns, [], [], 30)
                if not ready:
                    raise RuntimeError("a connection outlived its killed process by 30 s")
                for conn in ready:
                    conn.recv(1)
                    ended[by_conn[conn]] = time.monotonic() - started
                    open_conns.remove(conn)
            for conn in conns:
                conn.close()
            return ended
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,1000", help="MiB the killed worker holds, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="kills per size (the median is printed)")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    args = p.parse_args()
    rows = []
    print(f"{'MiB':>6} {'state process s':>16} {'bare process s':>15}")
    for mb in (int(s) for s in args.sizes.split(",")):
        kills = [one_kill(mb) for _ in range(args.repeats)]
        row = {
            "mib": mb,
            "state_s": statistics.median(k["state"] for k in kills),
            "bare_s": statistics.median(k["bare"] for k in kills),
            "kills": kills,
        }
        rows.append(row)
        print(f"{mb:>6} {row['state_s']:>16.3f} {row['bare_s']:>15.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": os.getloadavg()[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
