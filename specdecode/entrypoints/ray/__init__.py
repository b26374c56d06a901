"""Serving the OpenAI API from replicas of the engine on Ray Serve (the optional ``specdecode[ray]`` extra):
``specdecode.entrypoints.ray.serve``. Importing this package does not import Ray."""
