"""A host cut off with a standby lighthouse and no lighthouse fault (issue 14; docs/chaos.md gap 4).

While a group's host is cut, its heartbeat stream and its quorum calls try every lighthouse address in
turn (FT_LIGHTHOUSE=primary,standby), so when the link comes back the group may reach the standby first.
That is how the CI network chaos run (cell c4, host cut first, before the lighthouses were given their
peers) saw a cut 2-rank group never commit again: it came back on the standby, which knew nothing of the
job, and waited there alone ("lighthouse quorum ... did not complete before the deadline (no time left)",
round after round). Here the return through the standby is forced (an nft block keeps the primary's host
out of reach for a while after the link is up); the lighthouses know each other (`--peers`), so the standby
stands by and sends the group to the primary: it commits nothing on its own, and once the primary is
reachable it rejoins, heals and ends identical. Without `--peers` the standby serves it alone
(min_replicas 1 here) and it commits a history of its own while blocked.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from ft_harness import check_step_digests, stop_all, wait_until
from test_multihost import final_digests, only_readme_env, train_group

HEARTBEAT_TIMEOUT_MS = 2000


@pytest.mark.timeout(170)
def test_a_cut_group_that_comes_back_through_the_standby_lighthouse_rejoins_the_job_on_the_primary(
        simulated_hosts, tmp_path):
    hosts = simulated_hosts(4)  # h0 primary lighthouse, h1 standby, h2 and h3 a 2-rank group each
    primary_host, standby_host = hosts[0], hosts[1]
    addresses = [f"{h.address}:{hosts.free_port(h)}" for h in (primary_host, standby_host)]
    both = ",".join(addresses)
    logs = [tmp_path / "primary.log", tmp_path / "standby.log"]
    for host, address, log in zip((primary_host, standby_host), addresses, logs):
        with open(log, "ab") as out:
            hosts.python(host, "-m", "ft_core", "lighthouse", "--bind", address, "--http-bind", "off",
                         "--min-replicas", "1", "--join-timeout-ms", "1000",
                         "--heartbeat-timeout-ms", str(HEARTBEAT_TIMEOUT_MS), "--peers", both,
                         env=only_readme_env(), stdout=out, stderr=subprocess.STDOUT)
    groups = [train_group(hosts, hosts[2 + g], str(tmp_path), g, both) for g in (0, 1)]
    for g in groups:
        g.nproc = 2  # torchrun --nproc-per-node=2 on the group's host, as chaos cell c4
        g.start()
    wait_until(lambda: all(len(g.commits()) >= 5 for g in groups), 90, "both groups to commit 5 steps", groups)
    survivor, cut = groups
    cut_host = hosts[3]

    hosts.cut(cut_host)
    cut_at = time.time()
    before = survivor.last_step()
    wait_until(lambda: survivor.last_step() >= before + 5 and time.time() > cut_at + 2 * HEARTBEAT_TIMEOUT_MS / 1000,
               60, "the survivor to commit 5 steps while the other host is cut", groups)
    hosts.block(cut_host, primary_host)  # when the link is back, only the standby (and the survivor) is reachable
    hosts.restore(cut_host)
    restored_at = time.time()
    time.sleep(8.0)  # several reconnect rounds: the group's stream and quorum calls reach the standby only
    hosts.unblock(cut_host, primary_host)
    unblocked_at = time.time()
    alone = [c for c in cut.commits() if cut_at + 1 < c["time"] < unblocked_at]
    assert not alone, (f"the cut group committed {len(alone)} step(s) while it could reach no lighthouse but the "
                       f"standby (link back {restored_at - cut_at:.1f} s after the cut): the standby served it alone")
    assert survivor.last_step() > before + 5, "the survivor stopped while the other group was on the standby"

    resumed = len(cut.commits())
    wait_until(lambda: len(cut.commits()) >= resumed + 3, 60,
               "the cut group to rejoin the job on the primary and commit 3 steps", groups)
    stop_all(groups)
    assert any(e.get("type") == "heal" for e in cut.events()), "the cut group rejoined without healing"
    check_step_digests(groups, ranks=2)
    assert len(final_digests(groups)) == 1
    standby_log = logs[1].read_text(errors="replace")
    assert f"stands by for {addresses[0]}" in standby_log, standby_log[-2000:]
