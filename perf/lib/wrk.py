"""wrk (C, one thread: little of a 2-core machine) driven from Python: its Lua script and its run.

``script`` writes the whole Lua program around a benchmark's ``request`` function (``cycle``: given
bodies in turn; ``unique_texts``: a body with a text made unique per request): the path and
headers, a thread id (``tid``) and a counter (``n``) that make texts unique, and a ``done`` that
prints the window's figures as one JSON line (``WRK_RESULT {...}``), which ``run`` reads back:
requests, errors (socket errors and non-2xx answers), duration_us and wrk's own p50_us, p99_us
and max_us. With ``count_status`` each thread also counts 200, 503 and other answers (ok,
unavailable, other; socket_errors without the status errors), at the cost of a Lua call per answer.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

PREFIX = "WRK_RESULT "


def lua_string(value: str) -> str:
    """A Lua long-bracket literal (taken verbatim, no escapes) for ``value``."""
    level = 1
    while f"]{'=' * level}]" in value + "]":
        level += 1
    return f"[{'=' * level}[{value}]{'=' * level}]"


def lua_list(name: str, values: list[str]) -> str:
    """``local name = { ... }``: the strings a ``request`` function draws from."""
    return f"local {name} = {{\n" + ",\n".join(lua_string(v) for v in values) + "\n}\n"


def cycle(bodies: Sequence[bytes]) -> str:
    """A ``request`` function sending ``bodies`` in turn."""
    return (
        lua_list("bodies", [b.decode() for b in bodies]) + "request = function()\n  n = n + 1\n"
        "  return wrk.format('POST', path, headers, bodies[(n % #bodies) + 1])\nend\n"
    )


def unique_texts(texts: Sequence[str], template: bytes, nonce: str, before: bool = False) -> str:
    """A ``request`` function sending ``template`` (a JSON body whose text is ``\\0``) with each of
    ``texts`` in turn, made unique by `` (<nonce>-<tid>-<n>)`` after it (``before``: ``<nonce><tid>x<n> `` in front)."""
    head, _, tail = template.decode().partition("\\u0000")
    text = "texts[(n % #texts) + 1]"
    body = f"'{nonce}' .. tid .. 'x' .. n .. ' ' .. {text}" if before else f"{text} .. ' ({nonce}-' .. tid .. '-' .. n .. ')'"
    return (
        lua_list("texts", [json.dumps(t)[1:-1] for t in texts]) + "request = function()\n  n = n + 1\n"
        f"  local body = {lua_string(head)} .. {body} .. {lua_string(tail)}\n"
        "  return wrk.format('POST', path, headers, body)\nend\n"
    )


def script(path: str, headers: Mapping[str, str], request: str, delay_ms: float | None = None, count_status: bool = False) -> str:
    """A wrk Lua script: ``request`` (Lua defining the ``request`` function, which may use ``n``,
    ``tid``, ``path`` and ``headers``) with the preamble and the ``done`` that reports."""
    lua_headers = ", ".join(f"[ {lua_string(k)} ] = {lua_string(v)}" for k, v in headers.items())
    text = (
        "local n = 0\nlocal tid = 0\nlocal next_tid = 0\n"
        + ("local threads = {}\n" if count_status else "")
        + f"path = '{path}'\nheaders = {{{lua_headers}}}\n"
        "setup = function(thread) next_tid = next_tid + 1; thread:set('tid_init', next_tid)"
        + ("; table.insert(threads, thread)" if count_status else "")
        + " end\n"
        "init = function(args) tid = tid_init or 0; math.randomseed(os.time() + tid) end\n" + request
    )
    if delay_ms is not None:
        text += f"delay = function() return {delay_ms:.3f} end\n"
    fields = '\'WRK_RESULT {"requests":%d,"errors":%d,"duration_us":%d,\' .. \'"p50_us":%d,"p99_us":%d,"max_us":%d'
    values = (
        "summary.requests, e.connect + e.read + e.write + e.status + e.timeout, summary.duration,"
        " latency:percentile(50), latency:percentile(99), latency.max"
    )
    if count_status:
        text += (
            "ok = 0; unavailable = 0; other = 0\n"
            "response = function(status, headers, body)\n"
            "  if status == 200 then ok = ok + 1 elseif status == 503 then unavailable = unavailable + 1"
            " else other = other + 1 end\nend\n"
        )
        fields += ',"ok":%d,"unavailable":%d,"other":%d,"socket_errors":%d'
        values += ", o, u, x, e.connect + e.read + e.write + e.timeout"
    return (
        text
        + "done = function(summary, latency, requests)\n  local e = summary.errors\n"
        + (
            "  local o, u, x = 0, 0, 0\n  for _, t in ipairs(threads) do o = o + t:get('ok');"
            " u = u + t:get('unavailable'); x = x + t:get('other') end\n"
            if count_status
            else ""
        )
        + f"  io.write(string.format({fields}}}\\n', {values}))\nend\n"
    )


def run(url: str, script_path: Path, connections: int, seconds: float, timeout_s: float = 60.0) -> dict:
    """wrk, one thread, ``connections`` connections for ``seconds`` against ``url`` (host:port);
    the JSON figures of the script's ``done``. RuntimeError when wrk printed none."""
    command = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        f"{timeout_s:g}s",
        "-s",
        str(script_path),
        f"http://{url}",
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + timeout_s + 30, check=False)
    for line in out.stdout.splitlines():
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX) :])
    raise RuntimeError(f"wrk gave no result (exit {out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}")
