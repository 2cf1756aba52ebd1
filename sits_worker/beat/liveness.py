"""Does a beat release the schedules? A probe for the beat's container healthcheck.

One beat holds the turn at a time and renews it at every pass (`broker/schedules/passes.py`); a second
beat waits for it. So the fleet's beat is alive when some beat holds the turn, this one or the one this one
waits behind: `python -m sits_worker.beat.liveness` exits 0 then, 1 when none holds it (no pass within
`beat.turn_timeout`), and 2 when Redis cannot be reached (no proof of life either way).
"""

from __future__ import annotations

import sys

from broker.config.loading import load_settings
from broker.errors import SitsError
from broker.schedules.stats import beat_running
from broker.state.store import Store


def main() -> int:
    settings = load_settings()
    try:
        running = beat_running(Store.of(settings.redis))
    except SitsError as err:
        print(f"cannot tell whether a beat runs: {err.message}", file=sys.stderr)
        return 2
    if not running:
        print(f"no beat has held its turn within {settings.beat.turn_timeout:g} s (beat.turn_timeout)", file=sys.stderr)
        return 1
    print("a beat holds the turn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
