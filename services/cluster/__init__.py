"""The Ray cluster: joining or starting it, the persistent head ``pool deploy`` starts, its token
authentication and its processes."""
