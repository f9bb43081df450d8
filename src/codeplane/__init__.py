"""codeplane: a self-hostable backend for AI-assisted coding."""

__version__ = "0.1.0"
