"""Upstream protocols: OpenAI-compatible HTTP, Anthropic Messages, and the local engine."""
