"""antiphon.agents."""
