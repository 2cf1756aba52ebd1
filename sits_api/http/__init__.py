"""HTTP plumbing shared by v1 and v2: JSON bodies, content codings, the gunicorn worker class."""
