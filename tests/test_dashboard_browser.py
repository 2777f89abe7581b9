"""The lighthouse status page in headless Chromium (Debian's `chromium` package), driven over DevTools.

Setup on Debian: `apt-get update && apt-get install -y chromium`; the test skips when /usr/bin/chromium
is absent. It checks that the page loads with no external request, lists the members, and updates
as members leave and join, in states that mean what they say (training, healing, behind by N,
lost at a time). `FTL_DASHBOARD_SCREENSHOT=docs/dashboard.png` also saves the page as it looks then.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.control.types import QuorumMember

CHROMIUM = "/usr/bin/chromium"
websocket = pytest.importorskip("websocket", reason="pip install websocket-client to drive Chromium over DevTools")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} not installed (Debian: apt-get install -y chromium)")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
         "--disable-extensions", "--disable-dev-shm-usage", "--remote-debugging-port=0"]


class DevTools:
    """A minimal DevTools-protocol client over one page's websocket."""

    def __init__(self, ws_url: str) -> None:
        self._ws = websocket.create_connection(ws_url, timeout=20, suppress_origin=True)
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        self._ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv())
            if message.get("id") == self._next_id:
                assert "error" not in message, message
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def close(self) -> None:
        self._ws.close()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def devtools_port(profile: str, proc: subprocess.Popen) -> int:
    path = os.path.join(profile, "DevToolsActivePort")

    def ready() -> int | None:
        assert proc.poll() is None, f"chromium exited with {proc.returncode}"
        if os.path.exists(path):
            lines = open(path).read().split()
            return int(lines[0]) if lines else None
        return None

    return wait_for(ready, 20, "chromium's DevToolsActivePort")


def rows(page: DevTools) -> list[str]:
    """Replica ids of the member rows the page shows."""
    value = page.evaluate("JSON.stringify([...document.querySelectorAll('tr.member')].map(r => r.dataset.replicaId))")
    return json.loads(value) if value else []


def states(page: DevTools) -> dict[str, str]:
    """replica id -> the state text the page shows for it."""
    value = page.evaluate("JSON.stringify(Object.fromEntries([...document.querySelectorAll('tr.member')]"
                          ".map(r => [r.dataset.replicaId, r.children[1].textContent])))")
    return json.loads(value) if value else {}


@pytest.mark.timeout(60)
def test_status_page_lists_members_and_follows_changes_without_external_requests(processes) -> None:
    with LighthouseServer(quorum_tick_ms=50, heartbeat_timeout_ms=2_000) as server, \
            LighthouseClient(server.address()) as client, tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        streams = {rid: client.start_heartbeat_stream(rid) for rid in ("alpha", "beta")}
        assert all(s.wait_connected(5) for s in streams.values())
        joined: list[Any] = []
        threads = [threading.Thread(target=lambda r=rid: joined.append(client.quorum(
            QuorumMember(r, address=f"127.0.0.1:{7000 + len(r)}", step=4 if r == "alpha" else 2),
            timedelta(seconds=10))), name=f"test-join-{rid}") for rid in ("alpha", "beta")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert len(joined) == 2 and joined[0].replica_ids == ["alpha", "beta"]

        browser = processes.spawn([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port = devtools_port(profile, browser)
            targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
            page = DevTools(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
            try:
                page.send("Network.enable")
                page.send("Page.enable")
                page.send("Page.navigate", url=server.http_address() + "/")
                assert wait_for(lambda: rows(page) == ["alpha", "beta"], 20, "both members listed")
                assert page.evaluate("document.getElementById('quorum-id').textContent") == "1"
                # alpha is at the quorum's max step; beta, 2 behind and in the quorum, heals (one step
                # behind would be the normal skew, not "healing")
                assert states(page) == {"alpha": "training", "beta": "healing"}
                assert page.evaluate("document.getElementById('last-quorum').textContent") == "last quorum 1: alpha, beta"
                assert page.evaluate("document.querySelectorAll('button.kill').length") == 2

                # gamma asks for a quorum at step 0 while the others are not asking: it waits, far behind
                streams["gamma"] = client.start_heartbeat_stream("gamma")
                assert streams["gamma"].wait_connected(5)
                def join_gamma() -> None:
                    try:
                        client.quorum(QuorumMember("gamma", address="127.0.0.1:7009", step=0), timedelta(seconds=4))
                    except Exception as exc:  # its deadline: the others never asked again (expected)
                        joined.append(exc)

                waiter = threading.Thread(target=join_gamma, name="test-join-gamma", daemon=True)
                waiter.start()
                assert wait_for(lambda: states(page).get("gamma") == "behind by 4", 10, "gamma behind by 4")

                streams.pop("beta").stop()  # beta dies: its stream closes; it stays listed, lost, with the time
                lost = wait_for(lambda: states(page).get("beta", "").startswith("lost at ") and states(page)["beta"],
                                10, "beta shown lost")
                assert re.fullmatch(r"lost at \d\d:\d\d:\d\d", lost), lost
                assert page.evaluate("document.querySelector('tr[data-replica-id=beta]').classList.contains('lost')")
                assert page.evaluate("document.querySelectorAll('button.kill').length") == 2  # none for the lost
                assert rows(page) == ["alpha", "beta", "gamma"]
                if os.environ.get("FTL_DASHBOARD_SCREENSHOT"):  # to refresh docs/dashboard.png
                    page.send("Emulation.setDeviceMetricsOverride", width=1100, height=520, deviceScaleFactor=1,
                              mobile=False)
                    time.sleep(0.6)
                    shot = page.send("Page.captureScreenshot", format="png")["data"]
                    with open(os.environ["FTL_DASHBOARD_SCREENSHOT"], "wb") as f:
                        f.write(base64.b64decode(shot))
                waiter.join(10)

                page.send("Runtime.evaluate", expression="1")  # flush pending events
                urls = [e["params"]["request"]["url"] for e in page.events
                        if e.get("method") == "Network.requestWillBeSent"]
                assert any(u.endswith("/status") for u in urls), "the page polls /status"
                external = [u for u in urls if not (u.startswith(server.http_address() + "/")
                                                    or u.startswith(("data:", "about:")))]
                assert external == [], f"the page made external requests: {external}"
            finally:
                page.close()
        finally:
            os.killpg(browser.pid, signal.SIGTERM)  # its own session (processes.spawn): renderers too
            try:
                browser.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(browser.pid, signal.SIGKILL)
                browser.wait(timeout=10)
