"""Every process of a local deployment, named, with its CPU time and memory from /proc.

Shared by perf.drills.soak, perf.bench.cpu_cost and the tools that meter a window's CPU: tritonserver and its python backend stubs (model
and instance read from the stub's command line), the nginx front door, the OpenAI gateway, Redis
and the load generator (this process). CPU time is utime + stime of /proc/<pid>/stat (children
counted separately), RSS is VmRSS of /proc/<pid>/status.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Proc:
    """One process: ``name`` is unique in a deployment (``stub text_encoder_0_1``), ``group`` is what
    costs are summed over (``stub text_encoder``: all instances of a model)."""

    pid: int
    name: str
    group: str
    start_ticks: int  # /proc/<pid>/stat starttime: a reused pid is a different process


@dataclass(frozen=True)
class Sample:
    cpu_s: float  # utime + stime, seconds
    rss_bytes: int
    anon_bytes: int  # RssAnon: the part that is the process's own heap, not file or shared memory
    peak_rss_bytes: int = 0  # VmHWM: the highest RSS the process has had


def _stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    # comm may hold spaces and parentheses: the fields after it follow the last ')'.
    return text.rsplit(")", 1)[1].split()


def parent(pid: int) -> int:
    return int(_stat_fields(pid)[1])


def start_ticks(pid: int) -> int:
    return int(_stat_fields(pid)[19])


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children, every thread's)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(out))


def cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def stub_identity(args: list[str]) -> tuple[str, str] | None:
    """(model, instance) of a python backend stub's command line, None for another program.

    The stub is started as ``triton_python_backend_stub <model file> <shm region> <shm size>
    <growth> <parent pid> <backend dir> <ipc handle> <instance name> <runtime dir>``; the model file
    lies at ``<repository>/<model>/<version>/model.*``.
    """
    if not args or not args[0].endswith("triton_python_backend_stub") or len(args) < 9:
        return None
    model = Path(args[1]).parents[1].name
    return model, args[8]


def stubs(triton_pid: int) -> dict[int, tuple[str, str]]:
    """{pid: (model, instance)} of tritonserver's python backend stubs."""
    out = {}
    for child in children(triton_pid):
        try:
            ident = stub_identity(cmdline(child))
        except OSError:
            continue
        if ident is not None:
            out[child] = ident
    return out


def sample(pid: int) -> Sample | None:
    """CPU time and memory of one process; None once it is gone."""
    try:
        fields = _stat_fields(pid)
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, IndexError):
        return None
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    values = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return Sample(cpu, values.get("VmRSS", 0), values.get("RssAnon", 0), values.get("VmHWM", 0))


def _proc(pid: int, name: str, group: str) -> Proc | None:
    try:
        return Proc(pid, name, group, start_ticks(pid))
    except (OSError, IndexError, ValueError):
        return None


def deployment(triton=None, gateways: dict | None = None, redis=None, load_generator: bool = True) -> list[Proc]:
    """The processes of a running deployment: a server.deployment.Deployment (tritonserver, its stubs,
    its front door), server.gateway.GatewayProcess objects by name, a server.redis_process.RedisProcess,
    and this process as the load generator."""
    found: list[Proc | None] = []
    if triton is not None and triton.process is not None:
        tpid = triton.process.pid
        found.append(_proc(tpid, "tritonserver", "tritonserver"))
        for child, (model, instance) in sorted(stubs(tpid).items(), key=lambda item: item[1][::-1]):
            found.append(_proc(child, f"stub {instance}", f"stub {model}"))
        door = getattr(triton, "front_door", None)
        if door is not None and door.process is not None:
            found.append(_proc(door.process.pid, "frontdoor master", "frontdoor (nginx)"))
            for k, worker in enumerate(children(door.process.pid)):
                found.append(_proc(worker, f"frontdoor worker {k}", "frontdoor (nginx)"))
    gateways = gateways or {}
    for name, gw in gateways.items():
        if gw.process is None:
            continue
        label = "gateway" if len(gateways) == 1 else f"gateway {name}"
        found.append(_proc(gw.process.pid, label, "gateway"))
        for k, child in enumerate(children(gw.process.pid)):
            found.append(_proc(child, f"{label} child {k}", "gateway"))
    if redis is not None and redis.process is not None:
        found.append(_proc(redis.process.pid, "redis", "redis"))
    if load_generator:
        found.append(_proc(os.getpid(), "load generator", "load generator"))
    return [p for p in found if p is not None]


def alive(proc: Proc) -> bool:
    """Still the same process (not exited, pid not reused)."""
    try:
        return start_ticks(proc.pid) == proc.start_ticks
    except (OSError, IndexError, ValueError):
        return False


def snapshot(procs: Iterable[Proc]) -> dict[str, Sample]:
    """A sample of every process still alive, by name."""
    out = {}
    for p in procs:
        s = sample(p.pid)
        if s is not None and alive(p):
            out[p.name] = s
    return out


def machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine so far, neighbours included (/proc/stat's first line
    less idle and iowait); None where it cannot be read."""
    try:
        ticks = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return (sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0.0)) / CLOCK_TICKS


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it (gone ones have no children)."""
    found, todo = [], [pid]
    while todo:
        found.append(p := todo.pop())
        todo += children(p)
    return found


def tree_rss(pid: int) -> int:
    """The RSS of ``pid`` and every process below it, in bytes."""
    return sum(s.rss_bytes for p in tree(pid) if (s := sample(p)) is not None)
