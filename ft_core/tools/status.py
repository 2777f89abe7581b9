"""`ftl status`: the lighthouse's quorum and members as a table (or JSON), read from its HTTP /status.

Where it looks, first match wins: `--lighthouse ADDR`, then FT_LIGHTHOUSE_HTTP, then FT_LIGHTHOUSE,
then http://127.0.0.1:29511 (the default `ftl lighthouse --http-bind`). ADDR may be several,
comma-separated. An `http://host:port` address is the status server itself; a bare `host:port`
is tried as the status server and then as a lighthouse gRPC address whose status server is on the
next port (the defaults 29510 -> 29511). The token comes from `--token` or FT_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from http.client import HTTPException
from typing import Any

from ft_core.control.rpc import client_ssl_context
from ft_core.errors import AuthError, ConfigError, RPCError
from ft_core.net import format_host_port, split_host_port

DEFAULT_STATUS_URL = "http://127.0.0.1:29511"


def status_urls(addr: str | None) -> list[str]:
    """Candidate base URLs of the lighthouse's status server for `addr` (see the module docstring)."""
    raw = addr or os.environ.get("FT_LIGHTHOUSE_HTTP") or os.environ.get("FT_LIGHTHOUSE") or DEFAULT_STATUS_URL
    urls: list[str] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        if item.startswith(("http://", "https://")):
            base = item.rstrip("/")
            urls.append(base.removesuffix("/status"))
            continue
        host, port = split_host_port(item, "lighthouse address",
                                     hint="or give the status server as http://HOST:PORT")
        scheme = "https" if client_ssl_context() is not None else "http"  # a CA configured: the job uses TLS
        urls.append(f"{scheme}://{format_host_port(host, port)}")
        urls.append(f"{scheme}://{format_host_port(host, port + 1)}")
    if not urls:
        raise ConfigError(f"no lighthouse address in {raw!r}; pass --lighthouse HOST:PORT")
    return list(dict.fromkeys(urls))


def fetch_status(addr: str | None, token: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET /status from the first candidate that answers with JSON."""
    problems = []
    for base in status_urls(addr):
        request = urllib.request.Request(f"{base}/status")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=client_ssl_context()) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise AuthError(f"GET {base}/status was rejected (401): pass --token or set FT_TOKEN to the job's "
                                f"token", peer=base, call="GET /status", code="UNAUTHENTICATED") from None
            problems.append(f"{base}: HTTP {exc.code}")
        except (OSError, HTTPException, ValueError) as exc:
            problems.append(f"{base}: {exc}")
    raise RPCError(f"no lighthouse status server answered ({'; '.join(problems)}); pass --lighthouse "
                   f"http://HOST:PORT (the lighthouse's --http-bind)", call="GET /status", code="UNAVAILABLE")


def member_state(member: dict[str, Any], max_step: int) -> str:
    """What a member is doing, in words that mean what they say (the dashboard applies the same rule).

    One step behind the fastest is normal (the quorum runs ahead of the step); more than that and
    the group cannot contribute until it heals: "healing" once it is in the quorum, else "behind by N".
    """
    if not member.get("healthy", False):
        return "lost"
    step = member.get("step")
    if step is None:
        return "joining"
    behind = max_step - int(step)
    if behind > 1:
        return "healing" if member.get("in_quorum") else f"behind by {behind}"
    if member.get("waiting") and not member.get("in_quorum"):
        return "waiting for quorum"
    return "training"


def member_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The members, plus the last quorum's participants that have left since (state "lost")."""
    rows = [dict(m, state=member_state(m, status["max_step"])) for m in status["members"]]
    present = {m["replica_id"] for m in rows}
    quorum = status.get("quorum") or {}
    for p in quorum.get("participants", []):
        if p["replica_id"] not in present:
            rows.append(dict(p, healthy=False, in_quorum=True, waiting=False, state="lost"))
    return rows


COLUMNS = ("replica", "state", "step", "manager", "store", "world size", "heartbeat")


def _cells(m: dict[str, Any]) -> list[str]:
    age = m.get("heartbeat_age_s")
    step = m.get("step")
    return [m["replica_id"], m["state"], "-" if step is None else str(step), m.get("address") or "-",
            m.get("store_address") or "-", str(m.get("world_size") or "-"),
            "-" if age is None else f"{age:.1f} s ago"]


def title(status: dict[str, Any]) -> str:
    quorum = status.get("quorum")
    return (f"quorum {status['quorum_id']}: {len(quorum['participants'])} participants, "
            f"issued {quorum['age_s']:.1f} s ago" if quorum else "no quorum issued yet")


def render(status: dict[str, Any]) -> Any:
    """A rich Table of the members, titled with the quorum (for a terminal)."""
    from rich.table import Table

    colors = {"lost": "red", "training": "green"}
    table = Table(title=title(status), caption=f"max step {status['max_step']} · min_replicas {status['min_replicas']}")
    for column in COLUMNS:
        table.add_column(column, overflow="fold")
    for m in member_rows(status):
        cells = _cells(m)
        color = colors.get(m["state"], "yellow")
        cells[1] = f"[{color}]{cells[1]}[/{color}]"
        table.add_row(*cells)
    return table


def render_plain(status: dict[str, Any]) -> str:
    """The same table as aligned plain text with every value in full (for pipes, grep and awk)."""
    table = [list(COLUMNS)] + [_cells(m) for m in member_rows(status)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = [title(status), *("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table),
             f"max step {status['max_step']} · min_replicas {status['min_replicas']}"]
    return "\n".join(lines)


def finished_line(status: dict[str, Any]) -> str | None:
    """The groups that ended their training (a group joining later behind them is refused), or None."""
    done = status.get("finished") or []
    if not done:
        return None
    return "finished: " + ", ".join(f"{f['replica_id']} at step {f['step']}" for f in done) + \
        " (a group joining behind that step with no live peer there is refused)"


def peers_line(status: dict[str, Any]) -> str | None:
    """The peer lighthouses (`ftl lighthouse --peers`) as this one last saw them, and whether it stands by; or None."""
    peers = status.get("peers") or []
    if not peers:
        return None
    seen = []
    for p in peers:
        if p.get("self"):
            seen.append(f"{p['address']} (this one)")
        elif p.get("reachable"):
            by = f", standing by for {p['standing_by_for']}" if p.get("standing_by_for") else ""
            seen.append(f"{p['address']} ({p.get('live_members', 0)} live at step {p.get('max_step', 0)}{by})")
        else:
            seen.append(f"{p['address']} (unreachable: {p.get('problem') or 'no answer yet'})")
    active = status.get("standing_by_for")
    role = f"standing by for {active}: members are sent there" if active else "serving the job"
    return f"lighthouses: {role}; peers " + ", ".join(seen)


def main(argv: list[str]) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(prog="ftl status", description="Show the lighthouse's quorum and members.")
    parser.add_argument("--lighthouse", default=None,
                        help="status server http://HOST:PORT or lighthouse HOST:PORT (default: FT_LIGHTHOUSE_HTTP, "
                             f"FT_LIGHTHOUSE, then {DEFAULT_STATUS_URL})")
    parser.add_argument("--token", default=None, help="the job's shared token (default FT_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print the raw /status JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the lighthouse")
    opts = parser.parse_args(argv)
    try:
        status = fetch_status(opts.lighthouse, opts.token or os.environ.get("FT_TOKEN") or None, opts.timeout)
    except (ConfigError, RPCError) as exc:
        print(f"ftl status: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    if opts.json:
        print(json.dumps(status, indent=2))
        return 0
    console = Console()
    if not console.is_terminal:  # piped: nothing truncated or wrapped
        print(render_plain(status))
        print(f"next quorum: {status['reason']}")
        for line in (finished_line(status), peers_line(status)):
            if line:
                print(line)
        return 0
    console.print(render(status))
    console.print(f"next quorum: {status['reason']}", markup=False)
    for line in (finished_line(status), peers_line(status)):
        if line:
            console.print(line, markup=False)
    return 0
