"""Who the caller is and what it may touch: keys checked per request, tenants, A/B routes."""
