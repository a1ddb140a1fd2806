#!/usr/bin/env python3
"""The GPU proof of issue 5 (item 6): one run on the lent GPU machine, a table at the end.

Run through scripts/gpu_check.sh on the device machine (it sets PYTHONPATH and installs the
carried wheels). Steps, each isolated (a failure is recorded and the rest still run), each
with its own timeout inside one overall budget:

  0 probe       ../shared/gpu/probe.py, copied to .probe/ (what the machine allows)
  1 imports     torch, cuda.bindings, nccl4py (NCCL version), nvidia-smi, commd/client, create_engine
  2 contract    pytest tests/contract -k nccl (NCCL_MULTI_RANK_GPU_ENABLE=1)
  3 1-rank      one daemon, one worker with CUDA tensors: every call checked
  4 2-rank      two workers on the one GPU: one daemon (NCCL_MULTI_RANK_GPU_ENABLE=1), else two
                daemons with different NCCL_HOSTID joined over --peer-listen
  5 ordering    a long kernel writes the buffer right before all_reduce_async / all_reduce
  6 fault       kill -9 a worker mid-call: WorldFailed within 1 s, replacement, correct again
  7 bench       daemon path vs in-process NCCL (torch.distributed), all_reduce 8 B .. 256 MiB

`--dry-run` (or COMMD_GPU_CHECK_DRY=1) runs the same orchestration on the host engine with
client.hostmem buffers (and gloo as the in-process comparator), for a machine without a GPU.
Writes $OUT/gpu_check.json (after every step), $OUT/daemons.log and, unless gpu_check.sh
already tees it, $OUT/gpu_check.log.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import concurrent.futures
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE / "gpu"))
sys.path.insert(0, str(REPO))

import procs  # noqa: E402
from procs import Daemon, Proc, ProcError, free_port, worker  # noqa: E402

PEER_SECRET = "gpu-check-secret-0123456789abcdef"  # >= 16 bytes; the daemons only talk on 127.0.0.1
MODES = ("one-daemon", "two-daemons")


SHARED_GPU = {"NCCL_MAX_CTAS": "16", "NCCL_NVLS_ENABLE": "0"}
SHARED_PROCESS = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", **SHARED_GPU}
LOOPBACK_HOSTS = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def nccl_env(shared_process: bool, host: str | None = None) -> dict[str, str]:
    """NCCL's settings for two ranks on the one GPU (a value already in the environment wins).

    `shared_process`: both ranks in one process (NCCL_MULTI_RANK_GPU_ENABLE, NCCL >= 2.30).
    Each rank's kernel waits on the other's, so neither may fill the GPU: NCCL's notes on
    that setting ask to cap the CTAs, and NVLink SHARP does not apply to ranks sharing a GPU.
    Else each process is a "host" of its own (`host`: its NCCL_HOSTID): NCCL joins them
    over its network transport, which must be loopback sockets, never the machine's own
    InfiniBand NICs (a loopback through them may be refused in a container, or hang)."""
    wanted = {"NCCL_DEBUG": "WARN", **(SHARED_PROCESS if shared_process else LOOPBACK_HOSTS)}
    env = {key: os.environ.get(key, value) for key, value in wanted.items()}
    if host is not None:
        env["NCCL_HOSTID"] = host
    return env
GPU_SIZES = [[8, 200], [64 << 10, 200], [1 << 20, 100], [16 << 20, 40], [256 << 20, 8]]
DRY_SIZES = [[8, 50], [64 << 10, 30], [1 << 20, 10]]


@dataclass
class Result:
    status: str  # PASS, FAIL or SKIP
    key: str = ""  # the key number
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Step:
    id: str
    title: str
    fn: Callable[[Ctx], Result]
    cap_s: float  # its own timeout
    reserve_s: float  # kept for it while earlier steps run


@dataclass
class Ctx:
    args: argparse.Namespace
    dry: bool
    tmp: Path
    out: Path | None
    log_file: Any = None
    # each step thread's deadline: a step abandoned at its timeout keeps its own (past), so
    # its waits end at once and it starts nothing on the next step's time
    deadlines: dict[int, float] = field(default_factory=dict)
    mode: str | None = None  # how two ranks shared the GPU in step 4
    two_rank_tried: bool = False  # step 4 ran (and mode None means no placement worked)
    probe: dict[str, Any] = field(default_factory=dict)
    daemon_logs: list[str] = field(default_factory=list)
    bench: list[dict[str, Any]] = field(default_factory=list)

    @property
    def engine(self) -> str:
        return "host" if self.dry else "nccl"

    @property
    def mem(self) -> str:
        return "host" if self.dry else "cuda"

    @property
    def deadline(self) -> float:
        return self.deadlines.get(threading.get_ident(), 0.0)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def until(self, seconds: float) -> float:
        """A deadline `seconds` from now, never past the step's."""
        return min(self.deadline, time.monotonic() + seconds)

    def log(self, line: str) -> None:
        print(line, flush=True)
        if self.log_file is not None:
            self.log_file.write(line + "\n")
            self.log_file.flush()


# ---- worlds: daemons and workers ---------------------------------------------------------

class World:
    """The daemons serving `n` ranks on the one GPU, placed by `mode`."""

    def __init__(self, ctx: Ctx, n: int, mode: str, tag: str) -> None:
        self.ctx, self.n, self.mode, self.tag = ctx, n, mode, tag
        self.name = f"{tag}-{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.daemons: list[Daemon] = []
        self.notes: list[str] = []
        self.placement = [0] * n

    def start(self) -> None:
        if self.mode == "one-daemon" or self.n == 1:
            self._start("A", nccl_env(shared_process=True), None)
            return
        for name in ("A", "B"):  # each its own NCCL "host"; B joins the world through A's peer port
            env = {**nccl_env(shared_process=False, host=f"gpucheck-{self.tag}-{name}"),
                   "COMMD_PEER_SECRET": PEER_SECRET}
            self._start(name, env, free_port())
        self.placement = [r * 2 // self.n for r in range(self.n)]

    def _start(self, name: str, env: dict[str, str], peer_port: int | None) -> None:
        ctx = self.ctx
        engine = ctx.engine
        for attempt in range(2):
            daemon = Daemon(f"{self.tag}-{name}", ctx.tmp, engine, env=env, peer_port=peer_port,
                            log_dir=ctx.tmp)
            self.daemons.append(daemon)
            try:
                info = daemon.wait_ready(ctx.until(45))
            except ProcError as exc:
                if attempt == 0 and engine == "nccl" and "invalid choice" in str(exc):
                    self.notes.append("--engine nccl refused by the CLI; used --engine auto")
                    self.daemons.pop()
                    engine = "auto"
                    continue
                raise
            if info.get("engine") not in (None, ctx.engine):
                self.notes.append(f"daemon {name} runs engine {info.get('engine')}")
            return

    def rank_args(self, rank: int) -> dict[str, Any]:
        daemon = self.daemons[self.placement[rank]]
        return {"sock": str(daemon.socket), "bootstrap": self.daemons[0].bootstrap, "world": self.name,
                "rank": rank, "n": self.n, "device": None if self.ctx.dry else 0, "mem": self.ctx.mem}

    def close(self) -> None:
        # all at once, and not for long: a step's measured result must not wait out two slow
        # NCCL teardowns in turn (past the step's time it would be thrown away as timed out)
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.daemons))) as pool:
            codes = list(pool.map(lambda daemon: daemon.proc.stop(5.0), self.daemons))
        for daemon, rc in zip(self.daemons, codes, strict=True):
            self.ctx.daemon_logs.append(
                f"==== daemon {daemon.name} ({self.mode}) rc={rc}\n{daemon.log_tail()}")


@contextlib.contextmanager
def world(ctx: Ctx, n: int, mode: str, tag: str) -> Iterator[World]:
    w = World(ctx, n, mode, tag)
    try:
        w.start()
        yield w
    finally:
        w.close()


def run_ranks(ctx: Ctx, w: World, role: str, extra: dict[str, Any], timeout: float,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """`role` on every rank of `w` at once; each rank's @@RESULT, or {"fatal": why} with the
    checks it reported before it was killed or died."""
    sync_dir = ctx.tmp / f"sync-{w.name}-{role}"
    sync_dir.mkdir(parents=True, exist_ok=True)
    workers = [worker(f"{w.tag}-{role}-r{r}", role, {**w.rank_args(r), "sync_dir": str(sync_dir), **extra},
                      log_dir=ctx.tmp, env=env) for r in range(w.n)]
    deadline = ctx.until(timeout)
    results: list[dict[str, Any]] = []
    for proc in workers:
        try:
            results.append(proc.wait_result(deadline))
        except ProcError as exc:
            checks = {p["name"]: p for ev, p, _ in proc.events if ev == "check" and isinstance(p, dict)}
            results.append({"fatal": str(exc), "checks": checks})
    for proc in workers:
        if proc.alive():
            proc.kill()
        for line in proc.lines:
            ctx.log(f"    {proc.name}: {line}")
        for ev, payload, _ in proc.events:
            if ev == "check":
                ctx.log(f"    {proc.name}: {payload}")
    return results


SECONDARY = ("CommTimeout", "MismatchError", "WorldFailed", "PeerLost")  # usually another rank's doing


def merge_checks(results: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Per check: ok on every rank (None where not applicable), and a failing rank's note
    (a rank's own error before another's timeout or mismatch that it caused)."""
    fatal = [f"rank {r}: {res['fatal']}" for r, res in enumerate(results) if "fatal" in res]
    merged: dict[str, dict[str, Any]] = {}
    for rank, res in enumerate(results):
        for name, check in res.get("checks", {}).items():
            entry = merged.setdefault(name, {"ok": check["ok"], "note": check.get("note", ""), "ranks": {}})
            entry["ranks"][rank] = check
    for entry in merged.values():
        failing = [(r, c.get("note", "")) for r, c in entry["ranks"].items() if c["ok"] is False]
        if failing:
            failing.sort(key=lambda rn: rn[1].startswith(SECONDARY))
            entry["ok"] = False
            entry["note"] = "; ".join(f"rank {r}: {note}" for r, note in failing)
        elif len(entry["ranks"]) < len(results):
            entry["ok"] = False  # a rank never reported it (killed, died)
            entry["note"] = f"only ranks {sorted(entry['ranks'])} reported"
    return merged, fatal


def judge_calls(results: list[dict[str, Any]], expected: int) -> Result:
    merged, fatal = merge_checks(results)
    applicable = {k: v for k, v in merged.items() if v["ok"] is not None}
    good = [k for k, v in applicable.items() if v["ok"]]
    bad = [k for k, v in applicable.items() if not v["ok"]]
    key = f"{len(good)}/{len(applicable)} calls ok"
    notes = [f"{k}: {applicable[k]['note']}" for k in bad]
    if fatal:
        notes.insert(0, "; ".join(fatal))
    if len(results) < expected or any("checks" not in r for r in results):
        notes.insert(0, "a rank gave no checks")
    engines = sorted({str(r.get("engine")) for r in results if "engine" in r})
    joins = [r.get("join_s") for r in results if "join_s" in r]
    status = "PASS" if applicable and not bad and not fatal and len(results) == expected else "FAIL"
    return Result(status, key, " | ".join(notes), {"checks": merged, "engine": engines, "join_s": joins})


# ---- steps ---------------------------------------------------------------------------------

def step_probe(ctx: Ctx) -> Result:
    probe = Path(ctx.args.probe)
    if ctx.args.skip_probe:
        return Result("SKIP", note="dry run" if ctx.dry else "--skip-probe")
    if not probe.exists():
        return Result("SKIP", note="no .probe/probe.py (copy ../shared/gpu/probe.py there)")
    # what the daemons and the in-process benchmark run with, so that its answers hold for
    # them (not NCCL_MULTI_RANK_GPU_ENABLE: the probe tries with and without it)
    proc = Proc("probe", [sys.executable, str(probe)], log_dir=ctx.tmp,
                env={**nccl_env(shared_process=False), **SHARED_GPU})
    try:
        proc.popen.wait(max(1.0, ctx.left()))
        killed = False
    except subprocess.TimeoutExpired:  # the rows it printed (each whole, when done) still steer step 4
        proc.kill()
        killed = True
    rows: dict[str, str] = {}
    current = None
    for line in proc.lines:
        ctx.log(f"    probe: {line}")
        m = re.match(r"\[(\w+)\] (.*)", line)
        if m:
            current = m.group(1)
            rows[current] = m.group(2)
        elif line.startswith("| check |"):
            current = None  # its own table repeats the rows
        elif current is not None and line.strip():
            rows[current] += "\n" + line  # a check's traceback

    def pair_ok(name: str) -> bool | None:
        text = rows.get(name)
        return None if text is None else text.count('"sum_ok": true') == 2

    def last_line(text: str) -> str:
        return text.strip().splitlines()[-1][:100] if text.strip() else "-"

    ctx.probe = {"plain": pair_ok("nccl_2ranks_1gpu_plain"), "hostid": pair_ok("nccl_2ranks_1gpu_hostid"),
                 "multirank": pair_ok("nccl_2ranks_1gpu_multirank")}
    ipc_text = rows.get("ipc_mem_and_event", "")
    ipc_ok = '"ipc_write_seen": true' in ipc_text
    nccl = re.search(r'"nccl_torch": "([^"]+)"', rows.get("versions", ""))
    key = f"torch NCCL {nccl.group(1) if nccl else '?'}; 2 ranks/GPU: " + ", ".join(
        f"{k} {'ok' if v else 'no' if v is False else '?'}" for k, v in ctx.probe.items())
    note = f"ipc mem+event: {'ok' if ipc_ok else last_line(ipc_text)}"
    if not nccl:
        note += f"; versions: {last_line(rows.get('versions', ''))}"
    for name, text in rows.items():
        if name.startswith("nccl_2ranks") and '"sum_ok": true' not in text:
            note += f"; {name[len('nccl_2ranks_1gpu_'):]}: {last_line(text)[:80]}"
    if killed:
        note = f"the probe did not finish in its time (killed; the rows before count); {note}"
    ok = proc.popen.returncode == 0 and ipc_ok and bool(ctx.probe["multirank"] or ctx.probe["hostid"])
    return Result("PASS" if ok and not killed else "FAIL", key, note, {"rows": rows})


IMPORTS = r"""
import importlib.metadata as md, json, subprocess, sys
engine = sys.argv[1]
info = {"python": sys.version.split()[0], "executable": sys.executable}
def attempt(key, fn):
    try:
        info[key] = fn()
    except BaseException as e:
        info[key] = "ERROR " + (type(e).__name__ + ": " + str(e))[:300]
def torch_info():
    import torch
    d = {"version": torch.__version__, "cuda": torch.version.cuda,
         "cuda_available": torch.cuda.is_available()}
    if d["cuda_available"]:
        d["device"] = torch.cuda.get_device_name(0)
        d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return d
attempt("torch", torch_info)
def cuda_bindings():
    import cuda.bindings
    return cuda.bindings.__version__
attempt("cuda_bindings", cuda_bindings)
def nccl4py():
    from nccl.bindings import nccl
    v = nccl.get_version()
    return {"code": v, "version": f"{v // 10000}.{v // 100 % 100}.{v % 100}", "module": nccl.__file__}
attempt("nccl4py", nccl4py)
def dists():
    out = {}
    for name in ("nccl4py", "cuda-bindings", "cuda-core", "cuda-pathfinder", "nvidia-nccl-cu13", "torch",
                 "cupy-cuda13x", "numpy", "ml-dtypes", "msgpack", "uvloop", "pytest", "pytest-asyncio",
                 "pytest-timeout", "packaging", "cryptography", "cffi"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out
attempt("dists", dists)
def unmet():
    from packaging.requirements import Requirement
    bad = []
    for text in md.requires("nccl4py") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(req.name + " missing")
            continue
        if not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name} {have} not {req.specifier}")
    return bad
attempt("nccl4py_unmet", unmet)
attempt("nvidia_smi", lambda: subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                             timeout=20).stdout.strip())
def repo():
    import client, commd, proto
    return {m.__name__: m.__file__ for m in (commd, client, proto)}
attempt("repo", repo)
def sealing():  # two daemons seal their peer frames (cryptography, which needs cffi's backend)
    from proto import peerframe
    lengths, header, payload = peerframe.FrameSeal(bytes(32)).seal(b"header", b"payload")
    opener = peerframe.FrameSeal(bytes(32))
    opened = opener.open_header(lengths, header), opener.open_payload(lengths, payload)
    assert opened == (b"header", b"payload"), opened
    return "ok"
attempt("sealing", sealing)
def engine_check():
    from commd.engine import create_engine
    e = create_engine(engine)
    name = getattr(e, "name", type(e).__name__)
    e.close()
    return name
attempt("engine", engine_check)
print("@@RESULT " + json.dumps(info), flush=True)
"""


def step_imports(ctx: Ctx) -> Result:
    ctx.log(f"    PYTORCH_CUDA_ALLOC_CONF here: {os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r} "
            "(workers run without it: PyTorch's default allocator)")
    proc = Proc("imports", [sys.executable, "-c", IMPORTS, ctx.engine], log_dir=ctx.tmp)
    info = proc.wait_result(ctx.deadline)
    for k, v in info.items():
        ctx.log(f"    {k}: {v}")

    def err(key: str) -> bool:
        return isinstance(info.get(key), str) and info[key].startswith("ERROR")

    torch_info: dict[str, Any] = info["torch"] if isinstance(info.get("torch"), dict) else {}
    nccl4py: dict[str, Any] = info["nccl4py"] if isinstance(info.get("nccl4py"), dict) else {}
    # the workers need torch (a CPU build serves the dry run: tensors and gloo)
    problems = [k for k in ("repo", "engine", "torch") if err(k)]
    if info.get("engine") not in (None, ctx.engine) and not err("engine"):
        problems.append(f"engine is {info.get('engine')}")
    if not ctx.dry:
        if not torch_info.get("cuda_available"):
            problems.append("torch sees no GPU")
        problems += [k for k in ("cuda_bindings", "nccl4py") if err(k)]
    unmet = info.get("nccl4py_unmet")
    key = f"NCCL {nccl4py.get('version', '-')} (nccl4py), torch NCCL {torch_info.get('nccl', '-')}"
    note = "; ".join([f"{p}: {info.get(p)}" if p in info else p for p in problems]
                     + ([f"nccl4py needs {unmet}"] if isinstance(unmet, list) and unmet else [])
                     # (only two daemons need it: step 4 decides, and fails there without it)
                     + ([f"peer sealing: {info.get('sealing')}"] if err("sealing") else [])
                     + [str(torch_info.get("device") or "no GPU")])
    if ctx.dry:
        note = f"dry run: GPU items informational; {note}"
    return Result("FAIL" if problems else "PASS", key, note, info)


def stand_in_or_real(param_id: str, engine: str) -> str:
    """"fake" for the CPU stand-ins of an engine (`<engine>-fake`, and `<engine>-abi`, which
    declines to run where a real driver is), "real" for the engine itself, else "other"."""
    if any(param_id.startswith(f"{engine}-{stand_in}") for stand_in in ("fake", "abi")):
        return "fake"
    return "real" if param_id == engine or param_id.startswith(f"{engine}-") else "other"


def contract_outcomes(xml: Path, engine: str) -> dict[str, dict[str, int]]:
    """Per variant ("real": the engine itself, "fake": its CPU stand-ins) the count of each
    outcome, from pytest's junit XML."""
    import xml.etree.ElementTree as ET

    counts: dict[str, dict[str, int]] = {}
    failures: list[str] = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "")
        m = re.search(r"\[(.*)\]$", name)
        pid = m.group(1) if m else ""
        variant = stand_in_or_real(pid, engine)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[child.tag]
                if child.tag != "skipped" and len(failures) < 4:
                    failures.append(f"{name}: {(child.get('message') or '')[:100]}")
                if child.tag == "skipped":
                    bucket = counts.setdefault(variant, {})
                    bucket.setdefault("skip_reason", (child.get("message") or "")[:120])  # type: ignore[arg-type]
                    if "one rank" not in (child.get("message") or ""):
                        bucket["skipped_other"] = bucket.get("skipped_other", 0) + 1
        bucket = counts.setdefault(variant, {})
        bucket[outcome] = bucket.get(outcome, 0) + 1
    counts["_failures"] = failures  # type: ignore[assignment]
    return counts


def step_contract(ctx: Ctx) -> Result:
    env = nccl_env(shared_process=True)
    xml = ctx.tmp / "contract.xml"
    # -v: one line per test, so a run killed at its timeout still says how far it got
    # only the plugins the suite uses: the GPU image has others (xdist, cov, benchmark...)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-v", "tests/contract", "-k", ctx.engine, "-p", "no:cacheprovider",
           "-p", "pytest_asyncio.plugin", "-p", "pytest_timeout", f"--junitxml={xml}",
           # a test stuck in a CUDA or NCCL call that let go of the GIL never sees the
           # signal's timeout: the thread method ends the run at that test's timeout instead
           "-o", "timeout_method=thread"]
    proc = Proc("contract", cmd, env=env, log_dir=ctx.tmp)
    try:
        proc.popen.wait(max(1.0, ctx.left() - 2))
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        timed_out = True
    time.sleep(0.2)
    lines = proc.lines
    for line in lines:
        if not re.search(r" PASSED", line):  # the failures, skips and summary; passes are counted
            ctx.log(f"    pytest: {line}")
    if timed_out or not xml.exists():
        seen: dict[str, int] = {}
        for m in re.finditer(r"\[([^\]]*)\] (PASSED|FAILED|SKIPPED|ERROR)", "\n".join(lines)):
            variant = stand_in_or_real(m.group(1), ctx.engine)
            seen[f"{variant} {m.group(2).lower()}"] = seen.get(f"{variant} {m.group(2).lower()}", 0) + 1
        key = ", ".join(f"{v} {k}" for k, v in sorted(seen.items())) or "-"
        rc = proc.popen.returncode
        why = "pytest timed out (killed) after" if timed_out else f"no junit xml (rc={rc});"
        last = next((ln for ln in reversed(lines) if "::" in ln), "")
        return Result("FAIL", key, f"{why} {last[:120]}; {proc.err_tail()}", {"tail": lines[-40:]})
    counts = contract_outcomes(xml, ctx.engine)
    failures: list[str] = counts.pop("_failures")  # type: ignore[assignment]
    real, fake = counts.get("real", {}), counts.get("fake", {})

    def show(c: dict[str, Any]) -> str:
        shown = [f"{v} {k}" for k, v in c.items() if k not in ("skip_reason", "skipped_other")]
        return ", ".join(shown) or "none"

    key = f"{ctx.engine}: {show(real)}" + (f"; fake: {show(fake)}" if fake else "")
    notes = list(failures)
    if real.get("skipped"):
        notes.append(f"{real['skipped']} skipped: {real.get('skip_reason', '')}")
    bad = sum(c.get("failed", 0) + c.get("errors", 0) for c in counts.values())
    # a skip is a failure here, but for the transfer case of a one-rank world (NCCL allows no
    # second rank on the GPU): that shows in step 4's mode, not as the engine's fault
    ok = (real.get("passed", 0) > 0 and not real.get("skipped_other") and not bad
          and proc.popen.returncode == 0)
    return Result("PASS" if ok else "FAIL", key, " | ".join(notes), {"counts": counts, "tail": lines[-40:]})


def add_kernel_note(ctx: Ctx, since: int, mode: str) -> str:
    """What the daemons started since `since` logged about the add kernel (whether the
    2-rank bf16 sum took the kernel path: its result is the same either way); with one
    rank per daemon, whether they agreed on it (commd/engine/addagree.py)."""
    lines = [line.strip() for text in ctx.daemon_logs[since:] for line in text.splitlines()
             if "add kernel" in line or "take the add path" in line]
    loaded = [line for line in lines if "add kernel" in line]
    note = f"daemon: {loaded[-1][-160:]}" if loaded else ""
    if mode == "two-daemons":
        agreed = [line for line in lines if "take the add path" in line]
        note = "; ".join(filter(None, [note, f"add path agreed by {len(agreed)} of 2 daemons"
                                       + (f" ({agreed[-1][-90:]})" if agreed else "")]))
    return note


def abort_note(ctx: Ctx, since: int) -> str:
    """The longest ncclCommAbort the daemons started since `since` logged: their NCCL
    worlds wait that long (the event loop does not: the abort runs on the NcclGate's thread)."""
    took = [float(m.group(1)) for text in ctx.daemon_logs[since:]
            for m in re.finditer(r"ncclCommAbort of \d+ communicators took ([\d.]+) s", text)]
    return f"abort {max(took):.2f} s" if took else "no abort logged"


def step_one_rank(ctx: Ctx) -> Result:
    with world(ctx, 1, "one-daemon", "one") as w:
        res = judge_calls(run_ranks(ctx, w, "calls", {"timeout": 15.0, "seed": 3}, ctx.left() - 10), 1)
        if w.notes:
            res.note = "; ".join([*w.notes, res.note]).strip("; ")
    return res


def step_two_ranks(ctx: Ctx) -> Result:
    modes = [ctx.args.force_mode] if ctx.args.force_mode else list(MODES)
    if not ctx.args.force_mode and ctx.probe.get("multirank") is False and ctx.probe.get("hostid"):
        modes.reverse()  # the probe says only NCCL_HOSTID works here: try that first
    if ctx.dry and not ctx.args.force_mode:
        modes = ["one-daemon"]  # the host engine has no reason to split; --force-mode tests that path
    attempts: dict[str, Any] = {}
    best: Result | None = None
    ctx.two_rank_tried = True
    for i, mode in enumerate(modes):
        if ctx.left() < 15:
            ctx.log(f"    {mode}: not tried, the step's time is up")
            break
        share = ctx.left() / (len(modes) - i) if i < len(modes) - 1 else ctx.left()
        logs_before = len(ctx.daemon_logs)
        try:
            with world(ctx, 2, mode, f"two{i}") as w:
                res = judge_calls(run_ranks(ctx, w, "calls", {"timeout": 15.0, "seed": 5}, share - 10), 2)
                if w.notes:
                    res.note = "; ".join([*w.notes, res.note]).strip("; ")
            res.note = "; ".join(filter(None, [res.note, add_kernel_note(ctx, logs_before, mode)]))
        except Exception as exc:
            res = Result("FAIL", "world not started", f"{type(exc).__name__}: {exc}"[:400])
        res.key = f"{res.key} ({mode})"
        attempts[mode] = asdict(res)
        ctx.log(f"    {mode}: {res.status} {res.key} {res.note[:300]}")
        basic = res.details.get("checks", {}).get("all_reduce bf16 sum (default)", {}).get("ok")
        if basic and ctx.mode is None:
            ctx.mode = mode
        if best is None or res.status == "PASS" or (basic and best.status != "PASS"):
            best = res
        if basic:
            break
    assert best is not None
    for mode, other in attempts.items():
        if not best.key.endswith(f"({mode})"):
            best.note = f"{best.note} || {mode}: {other['status']} {other['key']}: {other['note'][:150]}"
    best.details = {"attempts": attempts, "mode": ctx.mode}
    return best


def two_rank_mode(ctx: Ctx) -> str:
    """The placement step 4 found working; else the one the probe says can (an NCCL before
    2.30 refuses two ranks on one GPU in one process: NCCL_MULTI_RANK_GPU_ENABLE is newer)."""
    if ctx.mode or ctx.args.force_mode:
        return ctx.mode or ctx.args.force_mode
    return "two-daemons" if ctx.probe.get("multirank") is False and not ctx.dry else "one-daemon"


def step_ordering(ctx: Ctx) -> Result:
    n = 1 if ctx.two_rank_tried and not ctx.mode else 2  # no 2-rank world worked: prove it on one rank
    mode = two_rank_mode(ctx)
    with world(ctx, n, mode, "order") as w:
        results = run_ranks(ctx, w, "ordering", {"timeout": 20.0, "sleep_ms": 300}, ctx.left() - 10)
    merged, fatal = merge_checks(results)
    bad = [f"{k}: {v['note']}" for k, v in merged.items() if not v["ok"]]
    async_key = next((k for k in merged if k.startswith("all_reduce_async")), None)
    async_ranks = list(merged.get(async_key, {}).get("ranks", {}).values()) if async_key else []
    returned = [c.get("returned_ms") for c in async_ranks]
    # measured against the kernel as it ran (its clock may differ from the calibration's)
    kernel = [c.get("kernel_ms") for c in async_ranks if isinstance(c.get("kernel_ms"), (int, float))]
    limit = 0.5 * min(kernel) if kernel else 150.0
    slow = [r for r in returned if isinstance(r, (int, float)) and r > limit and not ctx.dry]
    if slow:
        bad.append(f"all_reduce_async held the host {max(slow):.0f} ms behind a "
                   f"{min(kernel) if kernel else 300:.0f} ms kernel (not stream-ordered)")
    if not kernel and not ctx.dry:
        bad.append("the kernel's own time was not measured: the check has nothing to compare with")
    key = f"async returned in {max(returned):.1f} ms" if returned and all(
        isinstance(r, (int, float)) for r in returned) else "-"
    if kernel:
        key += f" (kernel {min(kernel):.0f} ms)"
    status = "PASS" if merged and not bad and not fatal else "FAIL"
    note = " | ".join(fatal + bad) + ("" if n == 2 else " (one rank: no 2-rank world worked)")
    return Result(status, f"{key}; {n} ranks, {mode}", note.strip(" |"), {"checks": merged})


def result_of(proc: Proc, deadline: float) -> dict[str, Any]:
    try:
        return proc.wait_result(deadline)
    except ProcError as exc:
        return {"fatal": str(exc)}


def step_fault(ctx: Ctx) -> Result:
    mode = two_rank_mode(ctx)
    logs_before = len(ctx.daemon_logs)
    with world(ctx, 2, mode, "fault") as w:
        args = {"timeout": 10.0, "seed": 9, "big_bytes": 64 << 20, "rebuild_s": 30}
        survivor = worker("fault-survivor-r0", "survivor", {**w.rank_args(0), **args}, log_dir=ctx.tmp)
        victim = worker("fault-victim-r1", "victim", {**w.rank_args(1), **args}, log_dir=ctx.tmp)
        victim.wait_event("joined", ctx.until(60))
        survivor.wait_event("in_call", ctx.until(30))
        time.sleep(0.5)  # the survivor's all_reduce is in the daemon, waiting for rank 1
        killed_at = time.time()
        victim.kill()
        time.sleep(0.3)
        replacement = worker("fault-replacement-r1", "replacement", {**w.rank_args(1), **args},
                             log_dir=ctx.tmp)
        got = result_of(survivor, ctx.until(ctx.left() - 8))
        rep = result_of(replacement, ctx.until(max(5.0, ctx.left() - 5)))
        for proc in (survivor, victim, replacement):
            for line in proc.lines:
                ctx.log(f"    {proc.name}: {line}")
    problems = [f"{who}: {res['fatal']}" for who, res in (("survivor", got), ("replacement", rep))
                if "fatal" in res]
    detect = got.get("at", killed_at) - killed_at
    if "fatal" not in got:
        if got.get("error") is None:
            problems.append("the survivor's call did not fail")
        elif not got.get("world_failed"):
            problems.append(f"survivor got {got.get('error')} (not a WorldFailed): "
                            f"{got.get('message', '')[:150]}")
        if detect > 1.0:
            problems.append(f"detected after {detect:.2f} s (> 1 s)")
        if detect < 0:
            problems.append("the call failed before the kill")
        if not got.get("rebuilt"):
            problems.append(f"attempt_reconnect never succeeded: {got.get('reconnect_errors')}")
    for who, res in (("survivor", got), ("replacement", rep)):
        if not res.get("ok_after") and "fatal" not in res:
            problems.append(f"{who} after rebuild: {res.get('check') or res.get('fatal')}")
    rebuild = got.get("rebuilt_at", killed_at) - got.get("at", killed_at)
    key = (f"{got.get('error')} after {detect:.2f} s; rebuilt+checked in {rebuild:.1f} s ({mode}); "
           f"{abort_note(ctx, logs_before)}")
    return Result("FAIL" if problems else "PASS", key, " | ".join(problems),
                  {"survivor": got, "replacement": rep, "detect_s": detect})


def fmt_size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def step_bench(ctx: Ctx) -> Result:
    sizes = DRY_SIZES if ctx.dry else GPU_SIZES
    mode = two_rank_mode(ctx)
    notes: list[str] = []
    half = ctx.left() / 2
    with world(ctx, 2, mode, "bench") as w:
        daemon_res = run_ranks(ctx, w, "bench", {"timeout": 30.0, "sizes": sizes, "per_size_s": 3}, half - 5)
    daemon_rows = daemon_res[0].get("rows") if daemon_res and "rows" in daemon_res[0] else None
    if daemon_rows is None:
        notes.append(f"daemon path: {daemon_res[0].get('fatal', '?')[:200] if daemon_res else '?'}")
    envs: list[tuple[str, dict[str, str] | None]] = [("", None)]
    if not ctx.dry:
        hostid = ("NCCL_HOSTID", nccl_env(shared_process=False))
        multi = ("NCCL_MULTI_RANK_GPU_ENABLE=1", nccl_env(shared_process=True))
        envs = [hostid, multi] if mode == "two-daemons" else [multi, hostid]
    torch_rows = None
    for i, (label, env) in enumerate(envs):
        if ctx.left() < 8:
            break
        port = free_port()
        procs_ = []
        for r in range(2):
            e = dict(env or {})
            if label == "NCCL_HOSTID":
                e["NCCL_HOSTID"] = f"gpucheck-bench-{r}"
            procs_.append(worker(f"torchbench-r{r}", "torchbench",
                                 {"rank": r, "n": 2, "port": port, "mem": ctx.mem, "sizes": sizes,
                                  "per_size_s": 3}, log_dir=ctx.tmp, env=e))
        # a first placement whose NCCL init hangs leaves the other its share
        deadline = ctx.until(max(10.0, (ctx.left() - 3) / (len(envs) - i)))
        outs = []
        for p in procs_:
            try:
                outs.append(p.wait_result(deadline))
            except ProcError as exc:
                outs.append({"fatal": str(exc)})
        for p in procs_:
            p.kill()
        if "rows" in outs[0]:
            backend, version = outs[0]["backend"], outs[0]["version"]
            torch_rows = outs[0]["rows"]
            with_env = f" with {label}" if label else ""
            notes.append(f"in-process: torch.distributed {backend}"
                         + (f" {version}" if version != backend else "") + with_env)
            break
        notes.append(f"in-process {label or ''} failed: {str(outs[0].get('fatal', '?'))[:200]}")
    rows: list[dict[str, Any]] = []
    for i, (nbytes, _) in enumerate(sizes):
        d = daemon_rows[i] if daemon_rows else {}
        t = torch_rows[i] if torch_rows else {}
        ratio = round(d["median_us"] / t["median_us"], 2) if d and t else None
        rows.append({"bytes": nbytes, "daemon_us": d.get("median_us"), "daemon_GBps": d.get("busbw_GBps"),
                     "inproc_us": t.get("median_us"), "inproc_GBps": t.get("busbw_GBps"), "ratio": ratio,
                     "iters": [d.get("iters"), t.get("iters")]})
    ctx.bench = rows
    ctx.log("")
    ctx.log(f"all_reduce {'bf16' if not ctx.dry else 'bf16 (daemon) / f32 (gloo)'}, 2 ranks, {mode}; "
            "latency = median per call (synchronous), busbw = 2(n-1)/n x bytes / time")
    ctx.log("| size | daemon median | daemon busbw | in-process median | in-process busbw "
            "| ratio (latency) |")
    ctx.log("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ctx.log(f"| {fmt_size(row['bytes'])} | {_us(row['daemon_us'])} | {_gb(row['daemon_GBps'])} | "
                f"{_us(row['inproc_us'])} | {_gb(row['inproc_GBps'])} | {row['ratio'] or '-'} |")
    ctx.log("")
    if not daemon_rows or not torch_rows:
        return Result("FAIL", "-", " | ".join(notes), {"rows": rows})
    small, large = rows[0], rows[-1]
    key = (f"{fmt_size(small['bytes'])}: {small['daemon_us']:.0f} vs {small['inproc_us']:.0f} us; "
           f"{fmt_size(large['bytes'])}: {large['daemon_GBps']:.1f} vs {large['inproc_GBps']:.1f} GB/s")
    return Result("PASS", key, " | ".join(notes), {"rows": rows})


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} us"


def _gb(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} GB/s"


STEPS = [
    Step("0", "probe", step_probe, 90, 0),
    Step("1", "imports", step_imports, 60, 20),
    Step("2", "contract", step_contract, 150, 40),
    Step("3", "1-rank world", step_one_rank, 60, 30),
    Step("4", "2-rank world", step_two_ranks, 130, 45),
    Step("5", "ordering", step_ordering, 60, 25),
    Step("6", "fault", step_fault, 60, 30),
    Step("7", "bench", step_bench, 120, 40),
]


# ---- running the steps -----------------------------------------------------------------------

def run_step(ctx: Ctx, step: Step, timeout: float) -> Result:
    """The step in a thread, so a step stuck past its timeout is abandoned (its processes killed)."""
    box: list[Result] = []

    deadline = time.monotonic() + timeout

    def target() -> None:
        ctx.deadlines[threading.get_ident()] = deadline
        try:
            box.append(step.fn(ctx))
        except Exception as exc:
            ctx.log(traceback.format_exc().rstrip())
            box.append(Result("FAIL", "-", f"{type(exc).__name__}: {exc}"[:500]))

    thread = threading.Thread(target=target, name=f"step-{step.id}", daemon=True)
    thread.start()
    thread.join(timeout + 3)  # the step's own waits end at its deadline; this is for a stuck one
    if thread.is_alive():
        procs.kill_all()
        thread.join(3)
        return Result("FAIL", "-", f"step timed out after {timeout:.0f}s (processes killed)")
    procs.kill_all()  # whatever the step left running
    return box[0]


def table(rows: list[tuple[Step, Result, float]]) -> list[str]:
    out = ["| step | result | key number | note |", "|---|---|---|---|"]
    for step, res, _secs in rows:
        note = res.note.replace("|", "/").replace("\n", " ")
        note = note if len(note) <= 220 else note[:217] + "..."
        out.append(f"| {step.id} {step.title} | {res.status} | {res.key.replace('|', '/')} | {note} |")
    return out


def nccl_warnings(logs: list[str], most: int = 12) -> list[str]:
    """The distinct NCCL WARN lines of the daemons' logs, most frequent first, with counts:
    the one device run must show at a glance whether NCCL objected to how it was driven (e.g.
    "Attempt to use communicator before the previous operation returned ncclSuccess", which
    the per-rank launch turns rely on NCCL not to say)."""
    counts: collections.Counter[str] = collections.Counter()
    for text in logs:
        for line in text.splitlines():
            at = line.find(" NCCL WARN ")
            if at >= 0:  # (without NCCL's "host:pid:tid [dev]" prefix, which differs per line)
                counts[line[at + 1:].strip()[:300]] += 1
    return [f"{n}x {line}" for line, n in counts.most_common(most)]


def write_json(ctx: Ctx, rows: list[tuple[Step, Result, float]], started: str) -> None:
    if ctx.out is None:
        return
    doc = {"started": started, "dry_run": ctx.dry, "host": platform.node(), "python": sys.version.split()[0],
           "engine": ctx.engine, "two_rank_mode": ctx.mode, "probe": ctx.probe,
           "steps": [{"id": s.id, "title": s.title, "seconds": round(secs, 1), **asdict(r)}
                     for s, r, secs in rows],
           "bench": ctx.bench}
    tmp = ctx.out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(ctx.out / "gpu_check.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("COMMD_GPU_CHECK_DRY") == "1",
                   help="host engine and host memory: the harness without a GPU")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for everything (default 480)")
    p.add_argument("--skip-probe", action="store_true", help="skip step 0 (the ~2 min probe)")
    p.add_argument("--only", default="", help="comma-separated step ids to run (default: all)")
    p.add_argument("--force-mode", choices=MODES, help="the 2-rank placement to use, no fallback")
    p.add_argument("--probe-s", type=float, default=90.0, help="the probe's timeout")
    p.add_argument("--probe", default=str(REPO / ".probe" / "probe.py"), help="the probe script")
    args = p.parse_args(argv)
    if args.dry_run and "0" not in args.only.split(","):
        args.skip_probe = True  # the probe needs a GPU; --only 0 runs it anyway
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    out_env = os.environ.get("OUT")
    out = Path(out_env) if out_env else None
    base = os.environ.get("GPU_CHECK_TMP", "/tmp")
    os.makedirs(base, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gck-", dir=base))  # short: unix socket paths <= 107 bytes
    ctx = Ctx(args=args, dry=args.dry_run, tmp=tmp, out=out)
    if out is not None and os.environ.get("GPU_CHECK_LOG_TEED") != "1":
        out.mkdir(parents=True, exist_ok=True)
        ctx.log_file = open(out / "gpu_check.log", "w")  # noqa: SIM115 - open for the whole run
    atexit.register(procs.kill_all)

    def on_signal(signum: int, _frame: object) -> None:
        procs.kill_all()
        ctx.log(f"gpu_check: signal {signum}, stopping")
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    steps = [s for s in STEPS if not args.only or s.id in args.only.split(",")]
    STEPS[0].cap_s = args.probe_s
    where = "DRY RUN (host engine)" if ctx.dry else "on the GPU"
    ctx.log(f"gpu_check {where}: {started}, budget {args.budget:.0f}s, "
            f"steps {','.join(s.id for s in steps)}, tmp {tmp}")
    rows: list[tuple[Step, Result, float]] = []
    for i, step in enumerate(steps):
        remaining = args.budget - (time.monotonic() - start)
        later = sum(s.reserve_s for s in steps[i + 1:])
        timeout = min(step.cap_s, max(remaining - later, step.reserve_s), remaining - 3)
        if timeout < 5 or (step.id == "0" and args.skip_probe):
            skipped = "dry run" if ctx.dry else "--skip-probe"
            res = Result("SKIP", note=skipped if step.id == "0" and args.skip_probe else "out of time")
            secs = 0.0
        else:
            ctx.log(f"[{step.id} {step.title}] start (timeout {timeout:.0f}s)")
            t0 = time.monotonic()
            res = run_step(ctx, step, timeout)
            secs = time.monotonic() - t0
        rows.append((step, res, secs))
        ctx.log(f"[{step.id} {step.title}] {res.status} in {secs:.1f}s: {res.key} {res.note[:400]}".rstrip())
        write_json(ctx, rows, started)
    if out is not None and ctx.daemon_logs:
        (out / "daemons.log").write_text("\n".join(ctx.daemon_logs)[-4_000_000:])
    shutil.rmtree(tmp, ignore_errors=True)
    ctx.log(f"\ngpu_check done in {time.monotonic() - start:.0f}s ({where}); "
            f"2-rank mode: {ctx.mode}")
    for line in table(rows):
        ctx.log(line)
    warnings = nccl_warnings(ctx.daemon_logs)
    ctx.log(f"\nNCCL WARN lines in the daemons' logs: {len(warnings) or 'none'}")
    for line in warnings:
        ctx.log(f"  {line}")
    return 0 if all(r.status != "FAIL" for _, r, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
