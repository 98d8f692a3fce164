"""The signed HTTP API for agents (the ``[api]`` extra): mount ``api.urls`` in the host's
URLconf; ``client.AgentClient`` is its other side."""
