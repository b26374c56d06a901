"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the same server and engine
as the OpenAI routes."""
