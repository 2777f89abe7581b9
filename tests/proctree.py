"""Process trees from /proc, for tests that must see every process a launcher (or torchrun) started,
including those in sessions of their own. A process is named by (pid, start time): stable against pid reuse."""

from __future__ import annotations

import os


def proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every live (not zombie) process we can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if fields[0] != "Z":
            table[int(name)] = (int(fields[1]), fields[19])
    return table


def descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every live descendant of `root`."""
    table = proc_table()
    found, frontier = set(), [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, start) in table.items():
            if ppid == parent and (pid, start) not in found:
                found.add((pid, start))
                frontier.append(pid)
    return found


def still_running(procs: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """Those of `procs` still alive (the same pid with the same start time)."""
    table = proc_table()
    return {(pid, start) for pid, start in procs if pid in table and table[pid][1] == start}
