"""antiphon.sessions."""
