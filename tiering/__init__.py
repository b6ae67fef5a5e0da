"""antiphon.tiering."""
