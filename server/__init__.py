"""antiphon.server."""
