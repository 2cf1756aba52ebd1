"""The one settings object: each concept's section gathered, validated and loaded."""
