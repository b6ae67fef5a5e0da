"""antiphon.web_ui."""
