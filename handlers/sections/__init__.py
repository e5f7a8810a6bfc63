"""The shipped handlers' config sections, importable without torch."""
