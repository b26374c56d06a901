"""Serving specdecode beyond one process.

``specdecode.serving.ray``: replicas of the engine behind one OpenAI endpoint on Ray Serve (the optional
``specdecode[ray]`` extra). Importing this package does not import Ray.
"""
