"""The training recipe behind models/tiny-target and models/tiny-draft (see models/README.md)."""
