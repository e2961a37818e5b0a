"""The engine: request types, scheduler, model runner, ``EngineCore`` and ``AsyncEngine``."""
