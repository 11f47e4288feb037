"""The package version, in a module of its own: code that reports it (/server_info, the
OpenAPI title) imports this leaf instead of the package, whose __init__ reaches the engine."""
__version__ = "0.1.0"
