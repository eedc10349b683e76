"""Servers a run starts on this machine listen on loopback only, unless a cluster address is configured.

A local Ray (``raycluster.ensure_ray`` -> ``start_local_ray``, what reward actors and
``train.world_size > 1`` start) is started here the way a run starts it, in a process of its own
that imported Ray first (as flytekit's Ray plugin does), and every listening socket of that
process and of everything it spawned is read from ``psutil``. The SGLang server's own sockets are
checked in tests/test_sglang.py (it needs ``.venv-sglang``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

LISTENERS = """
import json, sys, time
import psutil, ray  # ray first: its constants are read at import (tasks/resources.py imports it early)
from diffusionrl.raycluster import ensure_ray

assert ensure_ray(1)
time.sleep(1.0)  # the agents open their ports right after ray.init returns
me = psutil.Process()
found = []
for p in [me, *me.children(recursive=True)]:
    try:
        found += [[p.pid, p.name(), c.laddr.ip, c.laddr.port] for c in p.net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        pass
node_ip = ray.util.get_node_ip_address()
ray.shutdown()
print(json.dumps({"listening": found, "node_ip": node_ip}))
"""


def test_a_local_ray_listens_on_loopback_only():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", LISTENERS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    listening = report["listening"]
    assert len({name for _, name, _, _ in listening}) >= 3, listening  # the driver, the GCS, the raylet, ...
    exposed = [row for row in listening if row[2] not in LOOPBACK]
    assert not exposed, f"listening beyond loopback (pid, process, address, port): {exposed}"
    assert report["node_ip"] == "127.0.0.1"


# -- the SGLang server's rendezvous store ---------------------------------------------------------------

# A stand-in for the parts of SGLang 0.5.23 that ``server.LAUNCHER`` hooks: ``sglang serve`` parses
# its ports, then ``launch_server._start_scheduler_processes`` spawns the ranks, which rendezvous on
# tcp://127.0.0.1:<master port> (``gpu_worker.init_device_and_model``) and make a gloo group.
FAKE_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/cli/__init__.py": "",
    "sglang/cli/main.py": """
def main():
    import sys
    from sglang.multimodal_gen.runtime import launch_server
    return launch_server.launch(sys.argv)
""",
    "sglang/multimodal_gen/__init__.py": "",
    "sglang/multimodal_gen/runtime/__init__.py": "",
    "sglang/multimodal_gen/runtime/launch_server.py": """
import json, multiprocessing, sys, types


def listening():
    import psutil
    return [[c.laddr.ip, c.laddr.port] for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN]


class Payload:
    def __init__(self, port):
        self.port = port

    def materialize(self):
        return types.SimpleNamespace(master_port=self.port)


def rank(port, out):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    group = dist.new_group([0], backend="gloo")
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    out.put(listening())
    dist.destroy_process_group()


def _start_scheduler_processes(server_args, ranks, name_prefix):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=rank, args=(server_args.port, out))
    proc.start()
    found = out.get(timeout=120)
    proc.join(timeout=60)
    return found


def launch(argv):
    port = int(argv[argv.index("--master-port") + 1])
    ranks = _start_scheduler_processes(Payload(port), [(0, 0)], "w")
    print(json.dumps({"launcher": listening(), "rank": ranks, "port": port}), flush=True)
    return 0
""",
}


def test_the_sglang_ranks_rendezvous_on_a_store_that_listens_on_loopback_only(tmp_path):
    """torch's TCPStore server listens on every interface whatever host it is given, so the server
    is launched with the store hosted on loopback by the launching process and the ranks as clients."""
    from diffusionrl.rollout.sglang.server import SGLangServer, free_port

    for rel, text in FAKE_SGLANG.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    server = SGLangServer(sys.executable, "model", "fp32", workdir=tmp_path / "work")
    server.port, server.master_port = free_port(), free_port()
    command = server.command()
    assert command[command.index("--host") + 1] == "127.0.0.1"
    env = {**server.environment(), "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["port"] == server.master_port
    assert ["127.0.0.1", server.master_port] in report["launcher"]  # the store, hosted by the launcher
    exposed = [a for a in report["launcher"] + report["rank"] if a[0] not in LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert f"torch.distributed store on 127.0.0.1:{server.master_port}" in out.stderr
