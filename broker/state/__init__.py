"""Where SITS state lives: the Redis store, its key names, its Lua scripts and the embedded server."""
