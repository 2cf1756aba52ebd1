"""HTTP plumbing shared by v1 and v2: JSON bodies, content codings, error replies, the gunicorn worker class."""
