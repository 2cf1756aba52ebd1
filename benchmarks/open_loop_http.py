"""Open-loop HTTP load for the benchmarks: each request sent at its due time, its latency counted from then.

Each of `senders` threads keeps one keep-alive connection and sends `POST /v1/requests?wait=true` with a body
prepared beforehand. A request that waited for a free sender counts that wait, as an open-loop client's would.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
import urllib.parse


def send_at(url: str, key: str, arrivals: list[tuple[float, bytes]], senders: int) -> list[tuple[float, float | None]]:
    """Send each (due time on `time.monotonic()`, body); per request, (due time, seconds from then to its answer,
    None when it failed or was not answered with outputs)."""
    due: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
    found: list[tuple[float, float | None]] = []
    lock = threading.Lock()
    parts = urllib.parse.urlsplit(url)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def sender() -> None:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        while (job := due.get()) is not None:
            at, body = job
            if (wait := at - time.monotonic()) > 0:
                time.sleep(wait)
            try:
                connection.request("POST", "/v1/requests?wait=true", body=body, headers=headers)
                answer = connection.getresponse()
                ok = answer.status == 200 and json.loads(answer.read()).get("status") == "succeeded"
            except (OSError, http.client.HTTPException, ValueError):
                connection.close()
                ok = False
            with lock:
                found.append((at, time.monotonic() - at if ok else None))
        connection.close()

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(senders)]
    for thread in threads:
        thread.start()
    for arrival in arrivals:
        due.put(arrival)
    for _ in threads:
        due.put(None)
    for thread in threads:
        thread.join()
    return found
