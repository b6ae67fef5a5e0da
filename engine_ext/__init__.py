"""antiphon.engine_ext."""
