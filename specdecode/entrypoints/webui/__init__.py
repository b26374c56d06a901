"""The web chat page served at ``/`` by ``specdecode serve`` (``--no-webui`` turns it off): static files in this
package, no build step and nothing fetched from elsewhere."""
