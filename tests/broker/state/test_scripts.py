"""The Lua scripts as Python sees them: one typed attribute per script file, and reply codes that both
sides read from one enum (real Redis)."""

from __future__ import annotations

from importlib import resources

import pytest

from broker.state.replies import REPLY_ENUMS, lua_reply_tables, lua_table_name
from broker.state.scripts import SCRIPT_NAMES, Scripts, script_text
from broker.state.store import Store


def test_every_script_file_is_one_attribute_of_scripts() -> None:
    files = {path.name.removesuffix(".lua") for path in resources.files("broker.state").joinpath("lua").iterdir()
             if path.name.endswith(".lua")}
    assert set(SCRIPT_NAMES) == files - {"lib"}
    assert all(name in Scripts.__annotations__ for name in SCRIPT_NAMES)


@pytest.mark.parametrize("enum", REPLY_ENUMS, ids=lambda enum: enum.__name__)
def test_a_script_reads_each_reply_code_under_the_name_python_compares_with(store: Store, enum: type) -> None:
    table = lua_table_name(enum)
    for member in enum:
        answer = store.client.eval(lua_reply_tables() + f"return {table}.{member.name}", 0)
        assert answer == member.value, (table, member.name)


def test_every_registered_script_starts_with_the_reply_codes() -> None:
    assert all(script_text(name).startswith(lua_reply_tables()) for name in SCRIPT_NAMES)
