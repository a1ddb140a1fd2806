"""The supplementary groups of a connecting process (what --allow-gid admits by), from
SO_PEERGROUPS, also for a process with more groups than Python's getsockopt can take
and no /proc entry to fall back on (a peer in another PID namespace)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(30)

PROBE = textwrap.dedent("""
    import os, socket, sys
    from commd.server import supplementary_groups
    groups = set(range(5000, 5000 + int(sys.argv[1])))
    os.setgroups(sorted(groups))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    print(supplementary_groups(a, 0) == groups)  # pid 0: /proc cannot answer
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="setgroups needs root")
@pytest.mark.parametrize("count", [3, 300])
def test_every_group_is_seen_without_proc(count: int) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, str(count)], capture_output=True, text=True,
                         timeout=20, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
