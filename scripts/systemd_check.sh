#!/usr/bin/env bash
# The operator's path under a real systemd, on a machine whose PID 1 is not systemd
# (a container, a CI VM): boots systemd as PID 1 of a private PID and mount namespace,
# installs commd from this checkout as README "Operations" says, and checks that
#   - commd.socket and commd.service come up, `systemctl status` shows the daemon's STATUS=,
#     and the daemon adopted the socket (socket activation);
#   - a user in the group commd runs a 2-rank world, a user outside it is kept out;
#   - `commd status` answers and the metrics count exactly the calls made;
#   - after kill -9, systemd restarts the daemon and workers are served again.
# Needs root and systemd installed. Leaves nothing behind: the units, users, config
# and venv it made are removed at the end, and its systemd is killed.
# Usage: sudo scripts/systemd_check.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
[ "$(id -u)" = 0 ] || { echo "systemd_check: needs root" >&2; exit 2; }
command -v /lib/systemd/systemd >/dev/null || { echo "systemd_check: SKIP (no systemd)"; exit 0; }
venv=/opt/commd/venv
[ -e "$venv" ] && { echo "systemd_check: $venv exists; not touching a real install" >&2; exit 2; }

# Its own /tmp and /var/tmp: booting, systemd-tmpfiles empties /tmp, and the disk is
# this machine's (a mount namespace isolates mounts, not files).
setsid unshare --pid --fork --mount-proc --mount --uts --propagation private -- sh -c \
  'mount -t tmpfs tmpfs /tmp && mount -t tmpfs tmpfs /var/tmp &&
   exec /lib/systemd/systemd --system --unit=multi-user.target' </dev/null >/dev/null 2>&1 &
pid1=""
for _ in $(seq 100); do
  pid1="$(pgrep -xf '/lib/systemd/systemd --system --unit=multi-user.target' | head -1 || true)"
  [ -n "$pid1" ] && break
  sleep 0.1
done
[ -n "$pid1" ] || { echo "systemd_check: systemd did not start" >&2; exit 1; }
inside() { timeout 120 nsenter -t "$pid1" -p -m -u "$@"; }

cleanup() {
  kill -9 "$pid1" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid1" 2>/dev/null || break; sleep 0.1; done
  # -f: the users' last processes may still be exiting with their namespace
  for u in commd-check-in commd-check-out commd; do userdel -f "$u" 2>/dev/null || true; done
  groupdel commd 2>/dev/null || true
  rm -rf /opt/commd /etc/commd /etc/sysusers.d/commd.conf /etc/tmpfiles.d/commd.conf \
    /etc/systemd/system/commd.service /etc/systemd/system/commd.socket \
    /etc/systemd/system/*.wants/commd.*
}
trap cleanup EXIT
work=/opt/commd/check  # seen inside too (unlike /tmp), and removed with /opt/commd
for _ in $(seq 100); do
  state="$(inside systemctl is-system-running 2>/dev/null || true)"
  case "$state" in running|degraded) break ;; esac
  sleep 0.2
done

# A python outside /root and /home: the unit's ProtectHome hides those from the daemon.
/usr/bin/python3 -m venv "$venv"
mkdir -p "$work"
"$venv/bin/pip" install -q "$repo[metrics]"
cat >"$work/world.py" <<'EOF'
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from client import DaemonBackend, hostmem


def rank(r: int) -> float:
    with DaemonBackend("/run/commd/commd.sock", "systemd-check", r, 2, timeout=20) as comm:
        buf = hostmem.alloc(4096)
        for _ in range(10):
            buf.view(np.float32)[:] = r + 1
            comm.all_reduce(buf.ptr, 4096, dtype="f32")
        return float(buf.view(np.float32)[0])


with ThreadPoolExecutor(2) as pool:
    print("sums", list(pool.map(rank, range(2))))
EOF
chmod 0755 /opt/commd "$work" && chmod 0644 "$work/world.py"

inside bash -euo pipefail -c "
cd '$repo/deploy'
install -m 0644 commd.service commd.socket /etc/systemd/system/
install -D -m 0644 commd.sysusers /etc/sysusers.d/commd.conf && systemd-sysusers
install -D -m 0644 commd.tmpfiles /etc/tmpfiles.d/commd.conf && systemd-tmpfiles --create
install -D -m 0644 commd.toml /etc/commd/commd.toml
echo 'metrics_listen = \"127.0.0.1:9464\"' >> /etc/commd/commd.toml
useradd -M -s /bin/sh commd-check-in && usermod -aG commd commd-check-in
useradd -M -s /bin/sh commd-check-out
systemctl daemon-reload && systemctl enable --now commd.socket commd.service
sleep 2
systemctl is-active commd.socket commd.service
systemctl status commd.service --no-pager | grep -E 'Active:|Status:'
journalctl -u commd --no-pager | grep 'socket inherited: socket activation' >/dev/null
echo 'socket activation: adopted'
$venv/bin/commd status --socket /run/commd/commd.sock | sed -n 1p
su commd-check-in -c '$venv/bin/python $work/world.py'
if su commd-check-out -c '$venv/bin/python $work/world.py' 2>/dev/null; then
  echo 'a user outside the group got in' >&2; exit 1
fi
echo 'outside the group: refused'
curl -sf http://127.0.0.1:9464/metrics | grep -E '^commd_calls_total\\{op=\"all_reduce\",outcome=\"done\"\\} 20\\.0'
before=\$(systemctl show -p MainPID --value commd)
systemctl kill -s KILL commd.service
sleep 3
after=\$(systemctl show -p MainPID --value commd)
[ \"\$before\" != \"\$after\" ] && systemctl is-active commd.service
echo \"kill -9: restarted (pid \$before -> \$after)\"
su commd-check-in -c '$venv/bin/python $work/world.py'
systemctl stop commd.service commd.socket
"
echo "systemd_check: PASS"
