"""Helpers shared by the API tests: an authenticated test client, settings, error bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key


class Api:
    """A Flask test client that sends the admin key with every request."""

    def __init__(self, client: FlaskClient, key: str) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {key}"}

    def get(self, path: str, **kwargs: Any) -> TestResponse:
        return self.client.get(path, headers=self.headers, **kwargs)

    def post(self, path: str, **kwargs: Any) -> TestResponse:
        return self.client.post(path, headers=self.headers, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> TestResponse:
        return self.client.delete(path, headers=self.headers, **kwargs)

    def put(self, path: str, **kwargs: Any) -> TestResponse:
        return self.client.put(path, headers=self.headers, **kwargs)

    def as_user(self, user: str | None = None, group: str | None = None) -> dict[str, str]:
        """This key's headers, with an `X-SITS-User` and an `X-SITS-Group` where given."""
        return {**self.headers, **({"X-SITS-User": user} if user else {}), **({"X-SITS-Group": group} if group else {})}


def make_settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path,
                  **api: Any) -> Settings:
    """Settings whose model roots are tmp_path and the zoo; inputs and outputs only under tmp_path."""
    return Settings().with_overrides(
        redis={"url": redis_server.url, "key_prefix": store.keys.prefix},
        paths={"home": tmp_path / "home", "model_roots": (tmp_path, zoo_dir),
               "input_roots": (tmp_path,), "output_roots": (tmp_path,)},
        **({"api": api} if api else {}),
    )


def shared_roots(tmp_path: Path, zoo_dir: Path) -> dict[str, Any]:
    """A tenant record whose roots are the test's global ones: for tests of who owns work, where
    tenants share folders as an admin may configure them to (a tenant's own folder is the default)."""
    return {"model_roots": [tmp_path, zoo_dir], "input_roots": [tmp_path], "output_roots": [tmp_path]}


def two_tenants_sharing_roots(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    """Test settings with tenants acme and globex, both on the test's global roots (`shared_roots`)."""
    roots = shared_roots(tmp_path, zoo_dir)
    return make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(
        tenants={"acme": roots, "globex": roots})


def tenant_key(client: FlaskClient, store: Store, name: str, role: str, tenant: str) -> Api:
    """A client acting with a new key `name` of `role` in `tenant`."""
    return Api(client, create_api_key(store, name, role, tenant=tenant))


def tenant_copy(path: Path, root: Path, tenant: str) -> Path:
    """A copy of the file `path` in `tenant`'s folder under `root`, where its keys may read it by default."""
    copy = root / tenant / path.name
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(path.read_bytes())
    return copy


def queued_items(api: Api) -> int:
    """Items ready or in flight across every model queue, as GET /v1/status reports them."""
    return sum(depth["ready"] + depth["inflight"] for depth in api.get("/v1/status").get_json()["queues"].values())


def error_of(response: TestResponse) -> str:
    """The `error` message of a JSON error response (fails the test if the body is not one)."""
    body = response.get_json(silent=True)
    assert isinstance(body, dict) and isinstance(body.get("error"), str), (
        f"expected a JSON error body, got {response.status_code} {response.data[:300]!r}")
    return body["error"]
