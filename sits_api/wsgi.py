"""The WSGI entry point for production servers: `gunicorn sits_api.wsgi:app`.

Settings are loaded here, at the process's edge (SITS_CONFIG, SITS_* variables).
"""

from broker.config_loading import load_settings
from sits_api.app import create_app

app = create_app(load_settings())
