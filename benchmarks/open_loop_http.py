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
from collections import Counter


def send_at(url: str, key: str, arrivals: list[tuple[float, bytes]], senders: int,
            errors: Counter[str] | None = None) -> list[tuple[float, float | None]]:
    """Send each (due time on `time.monotonic()`, body); per request, (due time, seconds from then to its answer,
    None when it failed or was not answered with outputs). `errors`, if given, counts the failures by what
    they were: an HTTP status with the error's code (`202 queued`: not answered within the wait), or the
    exception."""
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
                reply = json.loads(answer.read())
                ok = answer.status == 200 and reply.get("status") == "succeeded"
                code = reply.get("error_code") or reply.get("code") or reply.get("status")
                why = "" if ok else f"{answer.status} {code}"
            except (OSError, http.client.HTTPException, ValueError) as err:
                connection.close()
                ok, why = False, type(err).__name__
            with lock:
                found.append((at, time.monotonic() - at if ok else None))
                if why and errors is not None:
                    errors[why] += 1
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
