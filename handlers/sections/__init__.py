"""The config sections of the shipped handlers, importable without torch."""
