"""OpenAI-compatible HTTP gateway in front of the engine."""

from .app import create_app

__all__ = ["create_app"]
