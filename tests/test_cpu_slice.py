"""sidecar/cpu_slice.py: the short CPU slice the sidecar's threads ask for (EEVDF, Linux 6.12+).

Each check runs in a child interpreter, since it changes the scheduling of the process it runs in.
Where the kernel keeps no custom slice the module says so and changes nothing; these tests then skip,
saying why."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

CHILD = textwrap.dedent("""
    import json, os, sys, threading
    from sidecar.cpu_slice import get_slice_ns, set_slice
    os.nice(3)  # an operator's nice value
    stop = threading.Event()
    before = threading.Thread(target=stop.wait)  # a thread that exists when the slice is set
    before.start()
    said = set_slice(int(sys.argv[1]))
    seen = {}
    def record():
        seen["after"] = get_slice_ns(threading.get_native_id())
    t = threading.Thread(target=record)  # one started afterwards inherits it
    t.start(); t.join()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if get_slice_ns() == get_slice_ns(threading.main_thread().native_id) else 1)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"said": said, "main": get_slice_ns(), "before": get_slice_ns(before.native_id),
                      "after": seen["after"], "child_same": status == 0, "nice": os.nice(0)}))
    stop.set(); before.join()
""")


def _run(us: int) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(us)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    got: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    if str(got["said"]).startswith("not set"):
        pytest.skip(f"no custom CPU slice on this host: {got['said']}")
    return got


def test_every_thread_gets_the_slice_new_threads_and_processes_inherit_it_and_nice_stays() -> None:
    got = _run(250)
    assert got["main"] == got["before"] == got["after"] == 250_000
    assert got["child_same"] is True
    assert got["nice"] == 3
    assert str(got["said"]).startswith("0.25 ms on ")


def test_a_slice_outside_what_the_kernel_accepts_is_clamped_to_its_range() -> None:
    assert _run(5)["main"] == 100_000  # 0.1 ms, the shortest
    assert _run(10**9)["main"] == 100_000_000  # 100 ms, the longest
