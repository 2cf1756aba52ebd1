"""The WSGI entry point for production servers: `gunicorn sits_api.wsgi:app`.

Settings are loaded here, at the process's edge (SITS_CONFIG, SITS_* variables). The objects made
while the app starts are then kept out of Python's full collections (`broker/state/startup_heap.py`).
"""

from broker.config.loading import load_settings
from broker.state.startup_heap import freeze_startup_heap
from sits_api.app import create_app

app = create_app(load_settings())
freeze_startup_heap()
