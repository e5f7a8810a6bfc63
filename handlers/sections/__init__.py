"""The shipped handlers' config sections, one module each, importing no torch."""
