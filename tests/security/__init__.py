"""Attacks a hostile tenant (or a local user) would try, each through a real stack, each closed."""
