"""Where a tenant's keys may read and write: its own roots, else its folder under each global root."""

from __future__ import annotations

from pathlib import Path

from broker.config.settings import Settings
from broker.tenants.roots import roots_for
from broker.tenants.settings import Tenant

GLOBAL = (Path("/data/in"), Path("/scratch"))


def test_an_admin_keeps_the_global_roots_and_a_tenant_without_its_own_gets_its_folder_under_each() -> None:
    admin = roots_for("input", global_roots=GLOBAL, tenant_name="ops", tenant=None, admin=True)
    acme = roots_for("input", global_roots=GLOBAL, tenant_name="acme", tenant=Tenant(), admin=False)

    assert admin.folders == GLOBAL and admin.setting == "paths.input_roots"
    assert acme.folders == (Path("/data/in/acme"), Path("/scratch/acme"))
    assert acme.holds(Path("/data/in/acme/x.npy")) and acme.holds(Path("/scratch/acme"))
    assert not acme.holds(Path("/data/in/acmeX/x.npy")) and not acme.holds(Path("/data/in/globex/x.npy"))


def test_a_tenant_s_own_roots_replace_its_folders_and_a_name_that_is_no_folder_name_gets_none() -> None:
    own = Tenant(output_roots=(Path("/teams/acme/results"),))

    assert roots_for("output", global_roots=GLOBAL, tenant_name="acme", tenant=own, admin=False).folders == (
        Path("/teams/acme/results"),)
    assert roots_for("input", global_roots=GLOBAL, tenant_name="acme", tenant=own, admin=False).folders == (
        Path("/data/in/acme"), Path("/scratch/acme"))  # (only the kinds it sets)
    for unsafe in ("a b", "../x", ".hidden", ""):  # key names are free text, and a key's name is its tenant
        assert roots_for("input", global_roots=GLOBAL, tenant_name=unsafe, tenant=None, admin=False).folders == ()


def test_tenant_roots_and_prices_are_read_as_the_configuration_writes_them() -> None:
    settings = Settings().with_overrides(
        tenants={"acme": {"input_roots": ["~/acme-data"], "max_priority": 7, "user_tiers": ["premium"]}},
        fair_share={"price_per_device_hour": {"cpu": 0.05, "cuda": 2.5}})

    acme = settings.tenants["acme"]
    assert acme.input_roots == (Path("~/acme-data").expanduser().resolve(),)
    assert (acme.max_priority, acme.user_tiers) == (7, ("premium",))
    assert settings.fair_share.price_per_device_hour == {"cpu": 0.05, "gpu": 2.5}  # what workers bill a GPU under


def test_a_default_priority_above_the_cap_and_two_gpu_prices_are_configuration_errors(tmp_path: Path) -> None:
    import pytest

    from broker.config.loading import load_settings
    from broker.errors import ConfigError

    config = tmp_path / "sits-config.yaml"
    config.write_text("tenants:\n  acme: {default_priority: 9, max_priority: 5}\n")
    with pytest.raises(ConfigError, match="default_priority 9 is above max_priority 5"):
        load_settings(path=config, environ={})
    config.write_text("fair_share:\n  price_per_device_hour: {cuda: 2.5, gpu: 3.0}\n")
    with pytest.raises(ConfigError, match="cuda 2.5 and gpu 3.0"):
        load_settings(path=config, environ={})
