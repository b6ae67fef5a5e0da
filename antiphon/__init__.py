"""Antiphon: session-aware LLM serving for chatbots and agents, built on vLLM."""

__version__ = "0.1.0"
