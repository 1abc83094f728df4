"""CPU accounting of started servers from /proc (loadtest.proc_cpu): a process tree's own work."""

from __future__ import annotations

import subprocess
import sys
import time

from loadtest.proc_cpu import CpuMeter, cpu_s, tree

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"


def test_a_tree_counts_its_childrens_cpu_and_an_idle_one_none() -> None:
    # a shell whose child burns 0.4 s of CPU, then sleeps (like a server's worker process)
    parent = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$0" & wait', BURN])
    idle = subprocess.Popen(["sleep", "30"])
    try:
        meter = CpuMeter({"busy": parent.pid, "idle": idle.pid})
        meter.start()
        for _ in range(100):  # until the child has burnt its 0.4 s
            if cpu_s(parent.pid) >= 0.35:
                break
            time.sleep(0.05)
        spent = meter.stop()
        assert len(tree(parent.pid)) == 2
        assert spent["busy"] >= 0.3
        assert spent["idle"] < 0.05
    finally:
        for p in (parent, idle):
            subprocess.run(["pkill", "-P", str(p.pid)], check=False)
            p.kill()
            p.wait()


def test_a_gone_process_reads_as_no_cpu() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    assert cpu_s(p.pid) == 0.0 and tree(p.pid) == [p.pid]
